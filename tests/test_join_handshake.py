"""The join handshake over real TLS on loopback (`joinwire`, `transport.joinport`,
`commands.join`): both sides prove the token bound to the connection's certificate, a
man in the middle is refused before anything is said, junk never fails the window, and
the token is held as ssh holds a key."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from fdl_fabric import joinwire
from fdl_fabric.clusterfile import JoinSpec
from fdl_fabric.commands import join as joiner
from fdl_fabric.events import Event, EventBus, Name
from fdl_fabric.planning.joinwindow import JoinLedger
from fdl_fabric.transport.joinport import SAID_PER_SOURCE, JoinPort, server_context

TOKEN = bytes(range(32))


class Said:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def named(self, name: Name) -> list[Event]:
        return [e for e in self.events if e.name is name]


@pytest.fixture
def said() -> Said:
    return Said()


@pytest.fixture
def port(said: Said) -> Iterator[JoinPort]:
    bus = EventBus()
    bus.add(said)
    spec = JoinSpec(min_ranks=1, discovery=True)
    opened = JoinPort("127.0.0.1", 0, TOKEN, JoinLedger(spec, "run-1"), bus)
    opened.open()
    yield opened
    opened.close()


def request(port: int, token: bytes = TOKEN, host: str = "pod-a") -> joiner.JoinRequest:
    return joiner.JoinRequest(address="127.0.0.1", port=port, token=token, host=host,
                              nproc=1, path="/tmp")


def dial_and_offer(req: joiner.JoinRequest) -> dict[str, Any]:
    stream = joiner.connect(req, lambda _: None)
    try:
        return joiner._admission(stream, req)
    finally:
        stream.close()


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.02)


def test_a_joiner_with_the_token_is_admitted_and_told_its_run(port: JoinPort,
                                                              said: Said) -> None:
    accept = dial_and_offer(request(port.port))
    assert (accept["run_id"], accept["host"], accept["ranks"]) == ("run-1", "pod-a", 1)
    wait_for(lambda: said.named(Name.JOIN_ADMITTED))
    assert said.named(Name.JOIN_ADMITTED)[0].host == "pod-a"


def test_a_joiner_that_hangs_up_before_the_world_forms_is_taken_out(
        port: JoinPort, said: Said) -> None:
    dial_and_offer(request(port.port))  # closes its connection once admitted
    wait_for(lambda: said.named(Name.JOIN_LEFT))
    assert port.members == {} and port.ledger.ranks_in == 0


def test_a_wrong_token_is_refused_on_both_sides_and_nothing_is_admitted(
        port: JoinPort, said: Said) -> None:
    with pytest.raises(joiner.Outcome) as caught:
        dial_and_offer(request(port.port, token=bytes(32)))
    assert caught.value.code == joiner.EXIT_PERMANENT
    assert "did not prove it holds this token" in str(caught.value)
    wait_for(lambda: said.named(Name.JOIN_REFUSED))
    assert "a wrong token" in said.named(Name.JOIN_REFUSED)[0].data["reason"]
    assert port.members == {} and port.ledger.joined == {}


def test_a_man_in_the_middle_with_its_own_certificate_is_refused_before_the_hello(
        port: JoinPort) -> None:
    """A proxy that ends TLS with a certificate of its own and relays the plain bytes:
    the launcher's proof binds the launcher's certificate, so the joiner refuses, and
    the proxy never sees a hello."""
    context, _ = server_context()
    listener = socket.create_server(("127.0.0.1", 0))
    seen = bytearray()

    def relay() -> None:
        """One thread, one message at a time each way, as the protocol goes."""
        conn, _ = listener.accept()
        front = context.wrap_socket(conn, server_side=True)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
        back = client.wrap_socket(socket.create_connection(("127.0.0.1", port.port)))
        for s in (front, back):
            s.settimeout(5)

        def exactly(sock: ssl.SSLSocket, n: int) -> bytes:
            data = b""
            while len(data) < n:
                chunk = sock.recv(n - len(data))
                if not chunk:
                    raise EOFError
                data += chunk
            return data

        def message(src: ssl.SSLSocket, dst: ssl.SSLSocket) -> None:
            head = exactly(src, 4)
            body = exactly(src, int.from_bytes(head, "big"))
            if src is front:
                seen.extend(body)
            dst.sendall(head + body)

        try:
            back.sendall(exactly(front, len(joinwire.MAGIC)))
            message(front, back)   # the joiner's nonce
            message(back, front)   # the launcher's nonce and proof
            message(front, back)   # the joiner's answer: a hello only if it trusted us
        except (OSError, EOFError):
            pass
        finally:
            front.close()
            back.close()

    threading.Thread(target=relay, daemon=True).start()
    with pytest.raises(joiner.Outcome) as caught:
        dial_and_offer(request(int(listener.getsockname()[1])))
    assert caught.value.code == joiner.EXIT_PERMANENT
    time.sleep(0.3)
    assert b"hello" not in bytes(seen) and b"pod-a" not in bytes(seen)
    assert port.members == {}
    listener.close()


def test_junk_never_fails_the_window_and_is_said_a_few_times_then_counted(
        port: JoinPort, said: Said) -> None:
    """Connections from 127.0.0.2 that send garbage, close at once, or say nothing:
    none ends the window, a real joiner (from 127.0.0.1) is still admitted, and the
    refusals of the junk's source are said three times, then counted."""
    def junk(kind: int) -> None:
        try:
            with socket.create_connection(("127.0.0.1", port.port), timeout=5,
                                          source_address=("127.0.0.2", 0)) as s:
                if kind == 0:
                    s.sendall(os.urandom(512))
                elif kind == 1:
                    s.sendall(b"GET / HTTP/1.1\r\n\r\n")
                time.sleep(0.05)
        except OSError:
            pass

    threads = [threading.Thread(target=junk, args=(n % 3,), daemon=True) for n in range(300)]
    for t in threads:
        t.start()
    accept = dial_and_offer(request(port.port, host="pod-real"))
    assert accept["host"] == "pod-real"
    for t in threads:
        t.join(30)
    wait_for(lambda: sum(port._under_way.values()) == 0, 30)
    port.flush(force=True)
    assert len(said.named(Name.JOIN_REFUSED)) == SAID_PER_SOURCE  # one source: 127.0.0.2
    counted = sum(e.data["count"] for e in said.named(Name.JOIN_REFUSALS))
    assert counted > 0
    assert port.ledger.closed is None
    assert [e.host for e in said.named(Name.JOIN_ADMITTED)] == ["pod-real"]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_token_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "token"
    path.write_text(joinwire.new_token())
    os.chmod(path, mode)
    with pytest.raises(joinwire.JoinError) as caught:
        joinwire.read_token_file(str(path))
    assert "readable by others" in str(caught.value) and "chmod 600" in str(caught.value)


def test_a_token_file_is_made_0600_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "token"
    text = joinwire.new_token()
    joinwire.write_token_file(str(path), text)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert joinwire.read_token_file(str(path)) == bytes.fromhex(text)


def test_a_short_or_garbled_token_is_refused() -> None:
    with pytest.raises(joinwire.JoinError, match="at least 32 hex digits"):
        joinwire.parse_token("abcd", "FDL_FABRIC_TOKEN")
    with pytest.raises(joinwire.JoinError, match="hex digits"):
        joinwire.parse_token("not hex at all", "FDL_FABRIC_TOKEN")


def test_the_launchers_proof_cannot_stand_for_a_joiners() -> None:
    binding, a, b = b"c" * 32, b"a" * 32, b"b" * 32
    launcher = joinwire.proof(TOKEN, "launcher", binding, a, b)
    assert not joinwire.proof_holds(TOKEN, "joiner", binding, a, b, launcher)
    assert joinwire.proof_holds(TOKEN, "launcher", binding, a, b, launcher)
    assert not joinwire.proof_holds(TOKEN, "launcher", b"d" * 32, a, b, launcher)


def test_persist_dials_again_at_once_after_an_agent_ran_and_backs_off_after_failures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """flodl's contract: transient ends back off 5 s doubling to 60 s; a permanent one
    stops; an agent that ran is followed by a dial at once (the next attempt waits)."""
    ends: list[Any] = [joiner.Outcome(1, "nothing answered")] * 6 + [
        0, joiner.Outcome(1, "closed"), 1, joiner.Outcome(2, "wrong token")]
    slept: list[float] = []

    def once(request: joiner.JoinRequest, say: Any) -> int:
        end = ends.pop(0)
        if isinstance(end, joiner.Outcome):
            raise end
        return int(end)

    monkeypatch.setattr(joiner, "join_once", once)
    code = joiner.join(request(1), persist=True, say=lambda _: None, sleep=slept.append)
    assert code == joiner.EXIT_PERMANENT and ends == []
    assert slept == [5, 10, 20, 40, 60, 60, 5], "no wait after the agent ran (0, then 1)"


def test_without_persist_a_join_ends_with_its_first_exit_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(joiner, "join_once", lambda request, say: (_ for _ in ()).throw(
        joiner.Outcome(1, "nothing answered")))
    assert joiner.join(request(1), persist=False, say=lambda _: None) == 1


def test_sixty_four_joiners_behind_one_address_dialling_at_once_are_all_admitted(
        port: JoinPort, said: Said) -> None:
    """Workers behind one NAT share an address: beyond the per-source bound the window
    turns a connection away before TLS, and the joiner dials again after a short random
    pause, within its dial's bound."""
    streams: list[Any] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        req = request(port.port, host=f"pod-{i}")
        stream = joiner.connect(req, lambda _: None)
        joiner._admission(stream, req)
        with lock:
            streams.append(stream)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert len(streams) == 64
        assert sorted(port.members) == sorted(f"pod-{i}" for i in range(64))
    finally:
        for s in streams:
            s.close()


# -- the command line ---------------------------------------------------------------------

def fdl(*args: str, env: Optional[dict[str, str]] = None,
        cwd: Optional[Path] = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fdl_fabric", *args], capture_output=True,
                          text=True, timeout=60, cwd=cwd,
                          env={k: v for k, v in {**os.environ, **(env or {})}.items()
                               if k != joinwire.ENV_TOKEN or env})


@pytest.mark.parametrize("args,said", [
    (["join", "127.0.0.1:1338", "--nproc", "1"], "--token-file: the window's token is needed"),
    (["join", "no-port-here", "--nproc", "1"], "--controller: expected HOST:PORT"),
    (["join", "127.0.0.1:1338", "--nproc", "1", "--devices", "0"],
     "give --nproc (CPU ranks) or --devices (GPUs), not both"),
    (["join", "127.0.0.1:1338", "--devices", "0,x"], "--devices: expected GPU numbers"),
    (["join", "127.0.0.1:1338", "--nproc", "1", "--path", "/no/such/folder"],
     "--path: no such folder"),
])
def test_a_bad_join_flag_is_refused_exit_2_naming_it(args: list[str], said: str,
                                                     tmp_path: Path) -> None:
    token = tmp_path / "token"
    joinwire.write_token_file(str(token), joinwire.new_token())
    if "--token-file" not in said:
        args = [*args, "--token-file", str(token)]
    done = fdl(*args)
    assert done.returncode == 2 and said in done.stderr, done.stderr


def test_a_token_file_others_can_read_is_refused_before_dialling(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(joinwire.new_token())
    token.chmod(0o644)
    done = fdl("join", "127.0.0.1:1", "--nproc", "1", "--token-file", str(token))
    assert done.returncode == 2 and "readable by others" in done.stderr
    assert "nothing answers" not in done.stderr


def test_the_token_may_come_from_the_environment_never_from_argv(tmp_path: Path) -> None:
    """With FDL_FABRIC_TOKEN and nothing listening, the joiner dials (and would keep
    dialling): the token was taken; no flag takes a token's value."""
    from fdl_fabric.commands import vocabulary

    assert not any("token" in f.name and f.name != "token_file" for f in vocabulary.FLAGS)
    proc = subprocess.Popen([sys.executable, "-m", "fdl_fabric", "join", "127.0.0.1:9",
                             "--nproc", "1"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, joinwire.ENV_TOKEN: joinwire.new_token()})
    try:
        assert proc.stderr is not None
        assert "nothing answers at 127.0.0.1:9 yet" in proc.stderr.readline()
    finally:
        proc.kill()
        proc.wait(10)


def test_a_dry_run_of_a_join_window_says_it_and_listens_nowhere(tmp_path: Path) -> None:
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    number = port.getsockname()[1]
    port.close()
    (tmp_path / "cluster.yml").write_text(
        "controller:\n  join:\n    discovery: true\n    min_ranks: 2\n"
        f"    port: {number}\n")
    done = fdl("launch", "-c", "cluster.yml", "--dry-run", "--", "true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (f"join window on 127.0.0.1:{number} (not opened: a dry run): quorum 2 ranks, "
            "target none") in done.stdout + done.stderr
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", number)) != 0, "nothing listens"


@pytest.mark.parametrize("case,offered", [("healthy-h200", (0,)), ("driver-gone", None)])
def test_devices_all_offers_the_gpus_nvidia_smi_lists_or_is_refused_without_one(
        case: str, offered: Optional[tuple[int, ...]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fdl_fabric.commands import joincli
    from fdl_fabric.errors import FdlError

    root = Path(__file__).resolve().parent
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir()
    (fakebin / "nvidia-smi").symlink_to(root / "progs" / "nvidia_smi_standin.py")
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
    monkeypatch.setenv("FDL_NVSMI_CASE", str(root / "fixtures" / "nvidia-smi" / case))
    token = tmp_path / "token"
    joinwire.write_token_file(str(token), joinwire.new_token())
    given = {"controller": "127.0.0.1:1338", "devices": "all", "token_file": str(token)}
    if offered is None:
        with pytest.raises(FdlError) as caught:
            joincli.join_request(given)
        assert caught.value.exit_code == 2 and "no GPU to offer" in str(caught.value)
    else:
        assert joincli.join_request(given).devices == offered
