"""The launcher's join port: where workers that dial in (`fdl-fabric join`) are met.

One TCP port, TLS on every connection (a certificate made for this window alone,
`server_context`), then the proofs of `joinwire` both ways: nothing is admitted, and
nothing about the run is said, to a peer that does not hold the token. An admitted
joiner's connection is kept (`Joined`) until the world forms; then the launch starts
its agent over it (`JoinTransport.start_agent`), and the same connection carries the
agent's frames and is its leash.

**Junk never fails the window** (issue 22's rule, flodl's weakness not copied): there
is no global reject count that ends anything. A source may have at most
`HANDSHAKES_PER_SOURCE` handshakes under way, all sources `HANDSHAKES_MAX`; beyond
them a connection is closed at once. Each handshake has `HANDSHAKE_S` seconds. A
refusal is said `SAID_PER_SOURCE` times per source address, then counted and said as
one line per `REPORT_EVERY` seconds (`flush`).

The operator's requests (`fdl-fabric start`, the window's status) come to the same port
with the same proof, so no token ever travels in a URL or in the clear.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import ssl
import tempfile
import threading
import time
from collections import Counter
from typing import Any, Optional, Union

from .. import __version__, joinwire
from ..clusterfile.names import host_name_problem
from ..errors import FdlError
from ..events import EventBus, Name
from ..planning.joinwindow import JoinLedger, Offer, Refusal
from ..tlsstream import Deadline, StreamClosed, TlsStream
from .base import AgentProcess, ByteSink

#: Seconds a connection has from its accept to its hello answered.
HANDSHAKE_S = 10.0
#: Handshakes under way at once from one source address, and from all.
HANDSHAKES_PER_SOURCE = 8
HANDSHAKES_MAX = 64
#: While handshakes are being turned away for the global bound (and `PRESSED_S` after),
#: a handshake has only this long: a joiner's takes milliseconds, a slow one is holding a
#: place (issue 22's ``HELLO_PROMPT``).
HANDSHAKE_PROMPT_S = 1.0
PRESSED_S = 5.0
#: Refusals said per source address before they are only counted.
SAID_PER_SOURCE = 3
#: Counted refusals are said as one line at most this often.
REPORT_EVERY = 5.0
#: Bytes read from a joined connection at a time.
READ_CHUNK = 65536


def server_context() -> tuple[ssl.SSLContext, bytes]:
    """A TLS server context with a certificate made now, for this window alone (an
    EC P-256 key that never touches a disk others can read: written to a private
    folder, loaded, removed), and the certificate's DER, which both proofs bind.
    Joiners check it by the proof, not by an authority."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fdl-fabric join window")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30))
            .sign(key, hashes.SHA256()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="fdl-join-") as folder:  # 0700
        cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        for path, data in ((cert_path, cert.public_bytes(serialization.Encoding.PEM)),
                           (key_path, key.private_bytes(
                               serialization.Encoding.PEM,
                               serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption()))):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        context.load_cert_chain(cert_path, key_path)
    return context, cert.public_bytes(serialization.Encoding.DER)


class Joined:
    """An admitted joiner: its offer, its connection, and the reader that hands the
    agent's bytes to the session once its agent is started (`attach`)."""

    def __init__(self, offer: Offer, peer: str, stream: TlsStream, port: JoinPort) -> None:
        self.offer = offer
        self.peer = peer
        self.stream = stream
        #: The window that admitted it: where a later joiner of the same host is found.
        self.port = port
        self._lock = threading.Lock()
        self._stdout: Optional[ByteSink] = None
        self._stderr: Optional[ByteSink] = None
        self.started = False
        #: Set once its accept is sent: the start may follow it, never pass it.
        self.accepted = threading.Event()
        self._reader = threading.Thread(target=self._read, name=f"joined {offer.host}",
                                        daemon=True)
        self._reader.start()

    @property
    def host(self) -> str:
        return self.offer.host

    def send(self, message: dict[str, Any]) -> None:
        """A message of the handshake's kind (the start, an abort); a gone peer is
        noticed by the reader."""
        with contextlib.suppress(StreamClosed, TimeoutError, OSError):
            self.stream.sendall(joinwire.pack(message), timeout=HANDSHAKE_S)

    def attach(self, stdout: ByteSink, stderr: ByteSink) -> None:
        """From now on the connection's bytes are the agent's output."""
        with self._lock:
            self._stdout, self._stderr = stdout, stderr
            self.started = True

    def _read(self) -> None:
        while True:
            data = self.stream.recv(READ_CHUNK)
            with self._lock:
                sink = self._stdout
            if not data:
                break
            if sink is None:  # a joiner says nothing until its agent starts
                self.stream.close()
                break
            sink.feed(data)
        with self._lock:
            sinks = (self._stdout, self._stderr)
        if sinks[0] is None:
            self.port.left(self)
        for s in sinks:
            if s is not None:
                s.close()

    def join(self, timeout: Optional[float]) -> None:
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout)

    @property
    def ready(self) -> bool:
        """Accepted, its agent not yet started, its connection open."""
        return self.accepted.is_set() and not self.started and not self.stream.closed


class JoinedAgentProcess(AgentProcess):
    """The agent of a joiner, at the other end of its connection. Its exit status is
    not ours to see: its loss is the connection's."""

    lost_reason = "the joined worker's connection was closed"

    def __init__(self, joined: Joined) -> None:
        self.joined = joined

    def write(self, data: bytes) -> None:
        self.joined.stream.sendall(data)

    def close_input(self) -> None:
        self.joined.stream.shutdown_write()

    def kill(self) -> None:
        """Cut the connection: the joiner closes its agent's input, the agent's leash."""
        self.joined.stream.close()

    def exit_status(self, timeout: float) -> Optional[int]:
        self.joined.join(timeout)
        return None

    def join(self, timeout: Optional[float] = None) -> None:
        self.joined.join(timeout)


class JoinPort:
    """The listening port of one launch's join window (see the module docstring)."""

    def __init__(self, bind: str, port: int, token: bytes, ledger: JoinLedger,
                 events: EventBus, scale: float = 1.0) -> None:
        self.bind, self.port = bind, port
        #: FLODL_NET_TIMEOUT_SCALE: the window's seconds, as the launch scales them.
        self.scale = scale
        #: How long a later attempt waits for a host of the world to join again.
        self.rejoin_wait = ledger.spec.join_timeout * scale
        self.opened_at = time.monotonic()
        self._token = token
        self.ledger = ledger
        self.events = events
        self.changed = threading.Condition()
        self.members: dict[str, Joined] = {}
        self._listener: Optional[socket.socket] = None
        self._context: Optional[ssl.SSLContext] = None
        self._binding = b""
        self._under_way: Counter[str] = Counter()
        self._said: Counter[str] = Counter()
        self._counted: Counter[str] = Counter()
        self._reported_at = 0.0
        self._pressed_at = -PRESSED_S
        self._closed = False

    # -- listening ---------------------------------------------------------------------
    def open(self) -> None:
        """Listen; an address this machine cannot bind is said, exit 1."""
        self._context, der = server_context()
        self._binding = joinwire.cert_hash(der)
        try:
            listener = socket.create_server((self.bind, self.port), reuse_port=False,
                                            backlog=128)
        except OSError as exc:
            raise FdlError(f"the join window cannot listen on {self.bind}:{self.port} "
                           f"({exc.strerror or exc}): free the port, or set "
                           "controller.join.port") from None
        self.port = int(listener.getsockname()[1])
        self._listener = listener
        self.opened_at = time.monotonic()
        threading.Thread(target=self._accept, name="join port", daemon=True).start()

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._closed:
            try:
                conn, address = listener.accept()
            except OSError:
                return
            source = str(address[0])
            with self.changed:
                full = sum(self._under_way.values()) >= HANDSHAKES_MAX
                busy = full or self._under_way[source] >= HANDSHAKES_PER_SOURCE
                if full:
                    self._pressed_at = time.monotonic()
                if not busy:
                    self._under_way[source] += 1
            if busy:
                conn.close()
                self._refused(source, "too many handshakes under way from it")
                continue
            with contextlib.suppress(OSError):  # small messages, each waited for
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._handshake, args=(conn, source),
                             name="join handshake", daemon=True).start()

    def close(self) -> None:
        """Stop listening, and cut every joiner whose agent never started. From here on
        the port says nothing: the launch's verdict is its last line, and a joiner
        dialling again meanwhile (``--persist``) is turned away in silence."""
        with self.changed:
            self._closed = True
            self.changed.notify_all()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        with self.changed:
            members = list(self.members.values())
        for joined in members:
            if not joined.started:
                joined.stream.close()

    # -- one connection ----------------------------------------------------------------
    def _deadline(self, started: float) -> float:
        """A handshake's deadline now: `HANDSHAKE_S`, or `HANDSHAKE_PROMPT_S` while the
        port is pressed."""
        if time.monotonic() - self._pressed_at < PRESSED_S:
            return started + HANDSHAKE_PROMPT_S
        return started + HANDSHAKE_S

    def _handshake(self, conn: socket.socket, source: str) -> None:
        started = time.monotonic()
        stream: Optional[TlsStream] = None
        kept = False
        try:
            stream = self._tls(conn, self._deadline(started))
            kept = self._converse(stream, source, lambda: self._deadline(started))
        except (joinwire.JoinError, StreamClosed, TimeoutError, OSError, ssl.SSLError,
                ValueError) as exc:
            self._refused(source, _said(exc))
        finally:
            with self.changed:
                self._under_way[source] -= 1
                if not self._under_way[source]:
                    del self._under_way[source]
            if not kept:
                if stream is not None:
                    stream.close()
                else:
                    conn.close()

    def _tls(self, conn: socket.socket, deadline: float) -> TlsStream:
        assert self._context is not None
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        tls = self._context.wrap_socket(conn, server_side=True)
        return TlsStream(tls)

    def _converse(self, stream: TlsStream, source: str, deadline: Deadline) -> bool:
        """The handshake after TLS; True when the connection is kept (a joiner in)."""
        def read(n: int) -> bytes:
            return stream.recv_exactly(n, deadline)

        if read(len(joinwire.MAGIC)) != joinwire.MAGIC:
            raise joinwire.JoinError("it does not speak the join protocol")
        theirs = joinwire.nonce_bytes(joinwire.unpack(read).get("nonce"))
        mine_hex = joinwire.new_nonce()
        mine = bytes.fromhex(mine_hex)
        binding = self._binding
        stream.sendall(joinwire.pack({"nonce": mine_hex, "proof": joinwire.proof(
            self._token, "launcher", binding, theirs, mine)}), timeout=HANDSHAKE_S)
        said = joinwire.unpack(read)
        if not joinwire.proof_holds(self._token, "joiner", binding, theirs, mine,
                                    said.get("proof")):
            stream.sendall(joinwire.pack({"refuse": "the token does not match the "
                                          "window's", "permanent": True}))
            raise joinwire.JoinError("a wrong token (its proof does not match)")
        if "operator" in said:
            stream.sendall(joinwire.pack(self._operator(str(said["operator"]))))
            return False
        offer = _offer(said.get("hello"))
        return self._admit(offer, stream, source)

    def _admit(self, offer: Offer, stream: TlsStream, source: str) -> bool:
        spec = self.ledger.spec
        refusal: Optional[Refusal] = None
        if offer.version != __version__:
            refusal = Refusal(f"it runs fdl-fabric {offer.version or '?'}, the launcher "
                              f"{__version__}: install the same version on both",
                              permanent=True)
        with self.changed:  # admitted and said before the window can count it
            if self._closed:
                refusal = Refusal("the run is ending: dial again for the next run")
            rejoin = refusal is None and self._rejoins(offer)
            if not rejoin:
                refusal = refusal or self.ledger.admit(offer)
            if rejoin and isinstance(rejoin, Refusal):
                refusal = rejoin
            if refusal is None:
                joined = Joined(offer, source, stream, self)
                self.members[offer.host] = joined
                self.events(Name.JOIN_REJOINED if rejoin else Name.JOIN_ADMITTED,
                            host=offer.host, peer=source,
                            ranks=self.ledger.ranks_of(offer), ranks_in=self.ledger.ranks_in,
                            quorum=spec.min_ranks, target=spec.target_ranks)
                self.changed.notify_all()
        if refusal is not None:
            with contextlib.suppress(StreamClosed, TimeoutError, OSError):
                stream.sendall(joinwire.pack({"refuse": refusal.reason,
                                              "permanent": refusal.permanent}))
            self._refused(source, refusal.reason, host=offer.host)
            return False
        stream.sendall(joinwire.pack({"accept": {
            "run_id": self.ledger.run_id, "host": offer.host,
            "ranks": self.ledger.ranks_of(offer), "cap": spec.max_join_timeout}}))
        joined.accepted.set()
        return True

    def _rejoins(self, offer: Offer) -> Union[bool, Refusal]:
        """After the world formed: a host of the world whose agent has run comes back for
        the next attempt (True), offering the same ranks (else its refusal); any other
        offer is the ledger's to refuse (False). The caller holds the lock."""
        before = self.members.get(offer.host)
        if self.ledger.closed is None or before is None:
            return False
        if before.ready:
            return Refusal(f"host {offer.host!r} already joined this run (a duplicate "
                           "join: give each worker its own --host)", permanent=True)
        if offer.ranks and offer.ranks != self.ledger.ranks_of(before.offer):
            return Refusal(f"host {offer.host!r} is in this run's world with "
                           f"{self.ledger.ranks_of(before.offer)} rank(s), it offers "
                           f"{offer.ranks}", permanent=True)
        return True

    def current(self, host: str) -> Optional[Joined]:
        """The latest joiner of ``host`` (a re-join replaces the one whose agent ran)."""
        with self.changed:
            return self.members.get(host)

    def wait_ready(self, host: str, timeout: float) -> Optional[Joined]:
        """A joiner of ``host`` ready to start its agent, waiting at most ``timeout``
        seconds for one to dial in again (`fdl-fabric join --persist` does, after each
        run); None if none did."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                joined = self.members.get(host)
                if joined is not None and joined.ready:
                    return joined
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self.changed.wait(min(left, 0.5))

    def left(self, joined: Joined) -> None:
        """A joiner's connection ended before its agent started: while the window is
        open its ranks no longer count; once the world formed, its host keeps its place
        (it may join again for the next attempt)."""
        with self.changed:  # every word of the port is said under its lock (`close`)
            if (self.ledger.closed is None and not joined.started and not self._closed
                    and self.members.get(joined.host) is joined):
                del self.members[joined.host]
                self.ledger.retract(joined.host)
                self.events(Name.JOIN_LEFT, host=joined.host, peer=joined.peer)
            self.changed.notify_all()

    def _operator(self, request: str) -> dict[str, Any]:
        """``start`` arms the window; ``status`` describes it."""
        with self.changed:
            if request == "start" and self._closed:
                return {"refuse": "the run is ending"}
            if request == "start":
                refused = self.ledger.arm()
                self.changed.notify_all()
                if refused is None:
                    self.events(Name.JOIN_START_ARMED, ranks_in=self.ledger.ranks_in)
                return {"ok": True} if refused is None else {"refuse": refused}
            if request == "status":
                return {"status": self.status()}
        return {"refuse": f"unknown request {request[:40]!r}"}

    def status(self) -> dict[str, Any]:
        """The window as `fdl-fabric status` shows it (the caller holds the lock): its
        phase (flodl's: waiting for the quorum, staging with it, training once formed,
        failed), who is in, and the seconds left in the window and to the cap."""
        spec, ledger = self.ledger.spec, self.ledger
        elapsed = time.monotonic() - self.opened_at
        if ledger.closed is None:
            phase = "staging" if ledger.ranks_in >= spec.min_ranks else "waiting"
        else:
            phase = "training" if ledger.closed.state.value == "formed" else "failed"
        return {"run_id": ledger.run_id, "phase": phase, "address": f"{self.bind}:{self.port}",
                "ranks_in": ledger.ranks_in, "quorum": spec.min_ranks,
                "target": spec.target_ranks, "start": spec.start.value,
                "armed": ledger.armed, "discovery": spec.discovery,
                "window_left": max(0.0, spec.join_timeout * self.scale - elapsed),
                "cap_left": max(0.0, spec.max_join_timeout * self.scale - elapsed),
                "hosts": {h: {"ranks": ledger.ranks_of(o), "peer": self.members[h].peer
                              if h in self.members else None}
                          for h, o in ledger.joined.items()}}

    # -- refusals ----------------------------------------------------------------------
    def _refused(self, source: str, reason: str, host: Optional[str] = None) -> None:
        if host is not None and host_name_problem(host) is not None:
            host = None  # a name that is not one is never shown as a host (the reason says)
        with self.changed:  # said under the lock: nothing after `close` (the verdict)
            if self._closed:
                return
            self._said[source] += 1
            if self._said[source] > SAID_PER_SOURCE:
                self._counted[source] += 1
                return
            self.events(Name.JOIN_REFUSED, peer=source, reason=reason, host=host,
                        last=self._said[source] == SAID_PER_SOURCE)

    def flush(self, *, force: bool = False) -> None:
        """The refusals counted since the last line, as one line (every `REPORT_EVERY`)."""
        now = time.monotonic()
        with self.changed:
            if self._closed or not self._counted or (
                    not force and now - self._reported_at < REPORT_EVERY):
                return
            counted, self._counted = dict(self._counted), Counter()
            self._reported_at = now
            self.events(Name.JOIN_REFUSALS, count=sum(counted.values()),
                        sources=sorted(counted)[:8], more_sources=max(0, len(counted) - 8))


def _offer(hello: object) -> Offer:
    """A hello's offer, each field checked; a `JoinError` names the first wrong one."""
    if not isinstance(hello, dict):
        raise joinwire.JoinError("no hello")
    host, nproc, devices = hello.get("host"), hello.get("nproc"), hello.get("devices")
    if not isinstance(host, str) or len(host) > 253:
        raise joinwire.JoinError("a hello's host is not a name")
    if nproc is not None and (not isinstance(nproc, int) or isinstance(nproc, bool)
                              or not 0 <= nproc <= 1 << 16):
        raise joinwire.JoinError("a hello's nproc is not a count")
    if devices is not None and (not isinstance(devices, list) or len(devices) > 1 << 16
                                or not all(isinstance(d, int) and not isinstance(d, bool)
                                           and 0 <= d < 1 << 16 for d in devices)):
        raise joinwire.JoinError("a hello's devices are not device numbers")
    run_id = hello.get("run_id")
    strings = {k: hello.get(k, "") for k in ("path", "version", "python")}
    if not all(isinstance(v, str) and len(v) <= 4096 for v in strings.values()) or \
            (run_id is not None and not isinstance(run_id, str)):
        raise joinwire.JoinError("a hello's path, version, python or run id is not text")
    return Offer(host=host, nproc=nproc, devices=None if devices is None else tuple(devices),
                 run_id=run_id, path=strings["path"], version=strings["version"],
                 python=strings["python"])


def _said(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"no hello within {HANDSHAKE_S:g}s"
    if isinstance(exc, (StreamClosed, ConnectionError)):
        return "it closed the connection during the handshake"
    if isinstance(exc, ssl.SSLError):
        return f"no TLS ({exc.reason or exc})"
    return str(exc)
