"""``fdl-fabric join CONTROLLER:PORT``: a worker that dials in (docs/join.md).

It runs on the worker host, with the fdl-fabric installed *there*: it never runs code the
launcher sends. It dials the launcher's join window (retrying while nothing answers,
bounded), speaks TLS, checks by the token's proof that the launcher is the one holding
the token before it says anything (`joinwire`), and offers its host name and ranks.
Once admitted it waits, bounded by the window's cap, for the world to form; then it
starts the agent of its own install (``python -m fdl_fabric.agent.main``) and carries
its frames both ways over the same connection. When the connection ends, it closes the
agent's input, and the agent stops its ranks: the leash, as with SSH.

Exit codes (flodl's contract): 0 the run's agent ended; 1 transient (nothing answered,
the window closed or failed, the connection dropped, the agent ended badly):
``--persist`` dials again, at once after an agent ran (the run's next attempt waits for
it), else after 5 s, doubling to 60 s; 2 permanent (a wrong token, a refused offer, bad
flags): ``--persist`` stops too.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from .. import __version__, joinwire
from ..errors import EXIT_USAGE
from ..tlsstream import StreamClosed, TlsStream

EXIT_DONE = 0
EXIT_TRANSIENT = 1
EXIT_PERMANENT = 2
#: Seconds one dial keeps trying while nothing answers (the launcher not up yet).
DIAL_S = 60.0
#: Seconds between two tries of a dial.
DIAL_EVERY = 1.0
#: Seconds the handshake has, once connected.
HANDSHAKE_S = 10.0
#: Beyond the window's cap, how long an admitted joiner waits for the world to form.
FORM_MARGIN_S = 30.0
#: ``--persist``: the wait before dialling again, doubling up to the last.
BACKOFF_S = (5.0, 10.0, 20.0, 40.0, 60.0)
#: Bytes read from the agent or the connection at a time.
CHUNK = 65536
#: Once the agent's output ended, how long it has to exit before it is killed.
AGENT_EXIT_S = 60.0
#: Set when the joiner was told to stop (TERM, INT, HUP) while its agent ran.
STOPPED = threading.Event()


@dataclass(frozen=True)
class JoinRequest:
    """What a joiner offers and where it dials."""

    address: str
    port: int
    token: bytes
    host: str
    nproc: Optional[int] = None
    devices: Optional[tuple[int, ...]] = None
    path: str = ""
    run_id: Optional[str] = None

    def hello(self) -> dict[str, Any]:
        return {"host": self.host, "nproc": self.nproc,
                "devices": None if self.devices is None else list(self.devices),
                "path": self.path, "run_id": self.run_id, "version": __version__,
                "python": sys.executable}


class Outcome(Exception):
    """How a join ended: its exit code and the line that says why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class TurnedAway(Outcome):
    """The connection ended before TLS: a window turning it away, or no window at all."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_TRANSIENT, message)


Say = Callable[[str], None]


def join(request: JoinRequest, *, persist: bool, say: Say,
         sleep: Callable[[float], None] = time.sleep) -> int:
    """Join, once or (``persist``) again: at once after its agent ran (the next attempt
    of the run waits for it), after a backoff (`BACKOFF_S`) after any other transient
    end; never again after a permanent one. The exit code of the last join."""
    failures = 0
    while True:
        ran = False
        try:
            code = join_once(request, say)
            ran = True
            message = "the run's agent ended" if code == EXIT_DONE else \
                "the run's agent ended badly"
        except Outcome as outcome:
            code, message = outcome.code, str(outcome)
        say(f"fdl-fabric join: {message}" if code else f"fdl-fabric join: {message}; done")
        if not persist or code == EXIT_PERMANENT or STOPPED.is_set():
            return code
        if ran:
            failures = 0
            say("fdl-fabric join: dialling again for the next attempt or run (--persist)")
            continue
        wait = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
        failures += 1
        say(f"fdl-fabric join: dialling again in {wait:g}s (--persist)")
        sleep(wait)


def join_once(request: JoinRequest, say: Say) -> int:
    """One dial, one admission, one agent; raises `Outcome` for anything but an agent
    that ran."""
    stream = connect(request, say)
    try:
        accept = _admission(stream, request)
        say(f"fdl-fabric join: joined run {accept.get('run_id')} as {request.host} with "
            f"{accept.get('ranks')} rank(s); waiting for the world to form")
        _until_start(stream, float(accept.get("cap") or 600.0) + FORM_MARGIN_S)
        say("fdl-fabric join: the world formed; starting the agent")
        return _run_agent(stream, request)
    finally:
        stream.close()


def connect(request: JoinRequest, say: Say,
            message: Optional[dict[str, Any]] = None) -> TlsStream:
    """A connection whose handshake is done (the hello, or an operator's ``message``,
    sent). A window that turns the connection away before TLS (too many handshakes
    under way from this address: many workers behind one NAT, a fleet dialling at once)
    is dialled again after a short random pause, within `DIAL_S`."""
    deadline = time.monotonic() + DIAL_S
    while True:
        try:
            return _handshake(_dial(request, say, deadline), request, message)
        except TurnedAway as exc:
            if time.monotonic() > deadline:
                raise Outcome(EXIT_TRANSIENT, str(exc)) from None
            time.sleep(random.uniform(0.05, 0.5))


def _dial(request: JoinRequest, say: Say, deadline: Optional[float] = None) -> socket.socket:
    """A TCP connection, trying every second while nothing answers, until ``deadline``
    (`DIAL_S` from now)."""
    deadline = deadline if deadline is not None else time.monotonic() + DIAL_S
    said = False
    while True:
        try:
            sock = socket.create_connection((request.address, request.port),
                                            timeout=HANDSHAKE_S)
            # Small messages both ways, each waited for: no Nagle delay behind them.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            if time.monotonic() > deadline:
                raise Outcome(EXIT_TRANSIENT, f"nothing answered at {request.address}:"
                              f"{request.port} within {DIAL_S:g}s ({exc.strerror or exc})"
                              ) from None
            if not said:
                say(f"fdl-fabric join: nothing answers at {request.address}:{request.port} "
                    f"yet ({exc.strerror or exc}); trying every {DIAL_EVERY:g}s for "
                    f"{DIAL_S:g}s")
                said = True
            time.sleep(DIAL_EVERY)


def _handshake(sock: socket.socket, request: JoinRequest,
               message: Optional[dict[str, Any]] = None) -> TlsStream:
    """TLS, then the proofs: the launcher proves first; ours, with the hello (or an
    operator's ``message``), only once it has."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # checked by the proof, bound to this certificate
    context.verify_mode = ssl.CERT_NONE
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    deadline = time.monotonic() + HANDSHAKE_S
    try:
        sock.settimeout(HANDSHAKE_S)
        tls = context.wrap_socket(sock)
        der = tls.getpeercert(binary_form=True) or b""
        stream = TlsStream(tls)
    except (OSError, ssl.SSLError) as exc:
        sock.close()
        raise TurnedAway(f"no TLS with {request.address}:{request.port} ({exc}): is it a "
                         "join window?") from None
    try:
        binding = joinwire.cert_hash(der)
        mine_hex = joinwire.new_nonce()
        mine = bytes.fromhex(mine_hex)
        stream.sendall(joinwire.MAGIC + joinwire.pack({"nonce": mine_hex}), HANDSHAKE_S)
        said = _read(stream, deadline)
        theirs = joinwire.nonce_bytes(said.get("nonce"))
        ours = joinwire.proof(request.token, "joiner", binding, mine, theirs)
        if not joinwire.proof_holds(request.token, "launcher", binding, mine, theirs,
                                    said.get("proof")):
            # Our proof, bound to this connection, lets a genuine launcher say "wrong
            # token" on its side too; the hello is not sent.
            with contextlib.suppress(Exception):
                stream.sendall(joinwire.pack({"proof": ours}), HANDSHAKE_S)
            raise Outcome(EXIT_PERMANENT, f"the launcher at {request.address}:{request.port} "
                          "did not prove it holds this token: the tokens differ (or it is "
                          "not your launcher); nothing was sent")
        said_now = {"hello": request.hello()} if message is None else message
        stream.sendall(joinwire.pack({"proof": ours, **said_now}), HANDSHAKE_S)
        return stream
    except BaseException:
        stream.close()
        raise


def _read(stream: TlsStream, deadline: float) -> dict[str, Any]:
    try:
        return joinwire.unpack(lambda n: stream.recv_exactly(n, deadline))
    except TimeoutError:
        raise Outcome(EXIT_TRANSIENT, "the launcher did not answer in time") from None
    except StreamClosed:
        raise Outcome(EXIT_TRANSIENT, "the launcher closed the connection") from None
    except joinwire.JoinError as exc:
        raise Outcome(EXIT_TRANSIENT, f"the launcher's answer is garbled ({exc})") from None


def _admission(stream: TlsStream, request: JoinRequest) -> dict[str, Any]:
    said = _read(stream, time.monotonic() + HANDSHAKE_S)
    if "refuse" in said:
        permanent = bool(said.get("permanent"))
        raise Outcome(EXIT_PERMANENT if permanent else EXIT_TRANSIENT,
                      f"refused by the launcher: {str(said['refuse'])[:500]}")
    accept = said.get("accept")
    if not isinstance(accept, dict):
        raise Outcome(EXIT_TRANSIENT, "the launcher's answer is neither an accept nor a "
                      "refusal")
    return accept


def _until_start(stream: TlsStream, bound: float) -> None:
    said = _read(stream, time.monotonic() + bound)
    if "abort" in said:
        raise Outcome(EXIT_TRANSIENT, f"the window failed: {str(said['abort'])[:500]}")
    if not said.get("start"):
        raise Outcome(EXIT_TRANSIENT, "the launcher said neither start nor abort")


def _run_agent(stream: TlsStream, request: JoinRequest) -> int:
    """The agent of this install, its stdin and stdout carried over the connection;
    its exit code (0 once it ran: ranks that failed are the run's verdict, not ours)."""
    agent = subprocess.Popen([sys.executable, "-m", "fdl_fabric.agent.main"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             cwd=request.path or None)
    assert agent.stdin is not None and agent.stdout is not None
    down = threading.Thread(target=_downward, args=(stream, agent.stdin), daemon=True,
                            name="join: to the agent")
    down.start()
    with _forwarding_stops(agent):
        stdout = agent.stdout.fileno()
        while True:
            data = os.read(stdout, CHUNK)
            if not data:
                break
            try:
                stream.sendall(data)
            except (StreamClosed, TimeoutError):
                break
        stream.shutdown_write()
        try:  # its output ended: it is exiting (its own ends are bounded by the kill grace)
            status = agent.wait(AGENT_EXIT_S)
        except subprocess.TimeoutExpired:
            agent.kill()
            status = agent.wait()
    return EXIT_DONE if status == 0 else EXIT_TRANSIENT


def _downward(stream: TlsStream, stdin: Any) -> None:
    """The launcher's bytes to the agent; at the connection's end, the agent's end of
    input (its leash)."""
    try:
        while True:
            data = stream.recv(CHUNK)
            if not data:
                break
            stdin.write(data)
            stdin.flush()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            stdin.close()


@contextlib.contextmanager
def _forwarding_stops(agent: subprocess.Popen[bytes]) -> Any:
    """TERM, INT or HUP to the joiner goes to its agent, which stops its ranks as it
    does at the end of its input (a systemd stop, a Ctrl-C)."""
    def forward(signum: int, _frame: Any) -> None:
        STOPPED.set()  # a stop (systemd, Ctrl-C): --persist does not dial again
        with contextlib.suppress(OSError):
            agent.send_signal(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT,
                                                    signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def ask_window(request: JoinRequest, what: str) -> dict[str, Any]:
    """An operator's request to a window (``start``, ``status``): one dial, the same
    proofs as a joiner's, the window's answer."""
    try:
        sock = socket.create_connection((request.address, request.port), timeout=HANDSHAKE_S)
    except OSError as exc:
        raise Outcome(EXIT_TRANSIENT, f"no join window answers at {request.address}:"
                      f"{request.port} ({exc.strerror or exc})") from None
    try:
        stream = _handshake(sock, request, {"operator": what})
    except TurnedAway:  # busy: once more, through the bounded dial
        stream = connect(request, lambda _: None, {"operator": what})
    try:
        return _read(stream, time.monotonic() + HANDSHAKE_S)
    finally:
        stream.close()


def parse_controller(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``); a `ValueError` naming what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"the controller is HOST:PORT (the join window's address), got "
                         f"{text!r}")
    return host.strip("[]"), int(port)


def usage_exit(message: str) -> Outcome:
    return Outcome(EXIT_USAGE, message)
