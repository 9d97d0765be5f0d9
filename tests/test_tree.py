"""The gateway tree without SSH: planning (`planning.tree`), the ``fanout`` key, the
transports `for_cluster` picks, a leaf's ssh command line, the relay's mux framing and
batching (`agent.relay`), the relay process over pipes with fake leaves, and the
launcher's end of a relay (`transport.gateway.Relay`) with a fake session."""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from fdl_fabric.agent import relay as mux
from fdl_fabric.agent import wire
from fdl_fabric.clusterfile import ConfigError, parse_cluster
from fdl_fabric.planning.tree import gateway_count, plan_tree
from fdl_fabric.transport import TransportError, bundle, for_cluster, gateway, tree_of
from fdl_fabric.transport.gateway import GatewayHost, GatewayTransport, Relay
from fdl_fabric.transport.leafssh import LEAF_KEX, leaf_ssh_argv
from fdl_fabric.transport.ssh import SshTransport
from fdl_fabric.transport.sshconfig import resolve_all_settings

ROOT = Path(__file__).resolve().parent.parent


def _hosts(n: int) -> list[str]:
    return [f"h{i:02d}" for i in range(1, n + 1)]


# -- planning ----------------------------------------------------------------------------------
def test_up_to_fanout_hosts_the_launch_stays_flat() -> None:
    tree = plan_tree(_hosts(64), 64)
    assert tree.flat and tree.direct == tuple(_hosts(64)) and tree.gateway_of("h01") is None
    assert plan_tree(_hosts(4), 4).flat
    assert not plan_tree(_hosts(5), 4).flat, "one host over the fanout makes a tree"


def test_36_hosts_with_fanout_4_are_4_gateways_of_8_leaves_in_roster_order() -> None:
    hosts = _hosts(36)
    tree = plan_tree(hosts, 4)
    assert tree.direct == ("h01", "h02", "h03", "h04")
    assert [g.host for g in tree.gateways] == list(tree.direct)
    assert [g.leaves for g in tree.gateways] == [tuple(hosts[4 + 8 * i:12 + 8 * i])
                                                 for i in range(4)]
    assert tree.gateway_of("h05") == "h01" and tree.gateway_of("h36") == "h04"
    assert tree.leaves_of("h02") == tuple(hosts[12:20]) and tree.leaves_of("h05") == ()
    assert tree.as_data()["gateways"]["h01"] == hosts[4:12]


@pytest.mark.parametrize(("hosts", "fanout", "gateways"), [
    (65, 64, 9), (100, 64, 10), (101, 64, 11), (1024, 64, 32), (4096, 64, 64),
    (9, 2, 2), (100, 3, 3), (2, 1, 1), (1024, 1024, 0),
])
def test_sqrt_h_gateways_capped_by_the_fanout(hosts: int, fanout: int, gateways: int) -> None:
    assert gateway_count(hosts, fanout) == gateways
    tree = plan_tree(_hosts(hosts), fanout)
    assert len(tree.gateways) == gateways
    if gateways:
        sizes = [len(g.leaves) for g in tree.gateways]
        assert sum(sizes) + gateways == hosts and max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True), "the first blocks take the extra host"
        leaves = [h for g in tree.gateways for h in g.leaves]
        assert leaves == _hosts(hosts)[gateways:], "contiguous blocks, in order"


def test_a_lost_gateway_is_replanned_out_and_connected_directly() -> None:
    """Issue 23 with issue 20: the next attempt's tree without the lost gateway h01; its
    leaves go to the gateways that are left, and h01 is a direct host (probed by the
    launcher's own connect), never a leaf that fails only when its agent starts."""
    hosts = _hosts(9)
    before = plan_tree(hosts, 2)
    assert [g.host for g in before.gateways] == ["h01", "h02"]
    after = plan_tree(hosts, 2, avoid={"h01"})
    assert [g.host for g in after.gateways] == ["h02", "h03"]
    assert after.direct == ("h02", "h03", "h01")
    assert after.gateway_of("h01") is None
    leaves = [h for g in after.gateways for h in g.leaves]
    assert leaves == hosts[3:], "every other host is a leaf, in roster order"
    assert len(after.gateways) == len(before.gateways), "the tree keeps its width"
    assert plan_tree(hosts, 2, avoid=set(hosts)).flat, "nobody left to be a gateway"
    assert plan_tree(hosts[:2], 2, avoid={"h01"}).flat, "within the fanout: flat"


def test_planning_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="fanout"):
        plan_tree(_hosts(3), 0)
    with pytest.raises(ValueError, match="twice"):
        plan_tree(["a", "b", "a"], 1)


def _file(workers: list[str], **top: Any) -> str:
    lines = [f"{k}: {v}" for k, v in top.items()] + ["workers:"]
    lines += workers
    return "\n".join(lines) + "\n"


def _ssh_worker(host: str, *extra: str) -> str:
    return "\n".join([f"  - host: {host}", "    nproc: 1", "    path: /srv",
                      *(f"    {e}" for e in extra)])


def _cluster(n: int, fanout: Optional[int] = 2, local: bool = False, spare: str = "",
             tunnel: str = "") -> Any:
    workers = []
    if local:
        workers.append("  - host: localhost\n    nproc: 1")
    for h in _hosts(n):
        extra = []
        if h == spare:
            extra.append("spare: true")
        if h == tunnel:
            extra.append("tunnel: true")
        workers.append(_ssh_worker(h, *extra))
    top = {"controller": "{host: 10.0.0.1}"}
    if fanout is not None:
        top["fanout"] = str(fanout)
    return parse_cluster(_file(workers, **top), file="c.yml", folder="/tmp")


def test_the_cluster_files_fanout_key_defaults_to_64_and_is_checked_with_its_line() -> None:
    assert _cluster(3, fanout=None).fanout == 64
    assert _cluster(3, fanout=1024).fanout == 1024
    for bad, said in (("0", "must be between 1 and 1024, got 0"),
                      ("1025", "must be between 1 and 1024, got 1025"),
                      ("wide", "expected an integer")):
        with pytest.raises(ConfigError) as info:
            parse_cluster(_file([_ssh_worker("a")], fanout=bad), file="c.yml", folder="/tmp")
        text = str(info.value)
        assert "c.yml:1: fanout:" in text and said in text, text


def test_local_workers_are_never_in_the_tree_and_spares_come_last() -> None:
    cluster = _cluster(9, fanout=2, local=True, spare="h01")
    tree = tree_of(cluster)
    assert "localhost" not in tree.direct
    assert tree.direct == ("h02", "h03"), "a spare is never a gateway while others can be"
    assert tree.gateways[-1].leaves[-1] == "h01"
    assert tree_of(cluster, fanout=64).flat, "a flag's fanout beats the file's"


def test_the_replanned_tree_gives_a_lost_gateway_a_direct_transport() -> None:
    cluster = _cluster(9)
    transports = for_cluster(cluster, resolve_all_settings(cluster), avoid={"h01"})
    assert type(transports["h01"]) is SshTransport
    assert isinstance(transports["h02"], GatewayHost)
    assert isinstance(transports["h03"], GatewayHost)
    leaf = transports["h04"]
    assert isinstance(leaf, GatewayTransport) and leaf.gateway.host == "h02"
    assert tree_of(cluster, avoid={"h01"}).as_data()["gateways"] == {
        "h02": ["h04", "h05", "h06"], "h03": ["h07", "h08", "h09"]}


def test_a_gateways_leaves_cost_the_launcher_no_open_files() -> None:
    from fdl_fabric import limits
    from fdl_fabric.transport import open_files_needed

    flat, tree = open_files_needed(_cluster(9, fanout=64)), open_files_needed(_cluster(9))
    assert flat - tree == 7 * limits.NOFILE_PER_HOST - 2 * limits.NOFILE_PER_RELAY


def test_for_cluster_gives_gateways_their_ssh_transport_and_leaves_a_gateway_one() -> None:
    cluster = _cluster(9, fanout=2, local=True)
    transports = for_cluster(cluster, resolve_all_settings(cluster))
    assert list(transports) == ["localhost", *_hosts(9)], "roster order"
    assert transports["localhost"].kind == "local"
    g1, g2 = transports["h01"], transports["h02"]
    assert isinstance(g1, GatewayHost) and isinstance(g1, SshTransport)
    assert g1.kind == "ssh", "a gateway is also a worker: its agent is an SSH session"
    assert g1.leaves == ("h03", "h04", "h05", "h06") and g2.leaves == ("h07", "h08", "h09")
    leaf = transports["h07"]
    assert isinstance(leaf, GatewayTransport) and leaf.gateway is g2
    assert leaf.describe().startswith("host h07 via gateway h02")
    assert leaf.details()["gateway"] == "h02"
    assert "starts 4 leaves (h03 .. h06)" in g1.describe()
    flat = for_cluster(cluster, resolve_all_settings(cluster), fanout=64)
    assert {type(t) for h, t in flat.items() if h != "localhost"} == {SshTransport}


def test_a_tunneled_leaf_is_refused_before_anything_is_contacted() -> None:
    cluster = _cluster(5, fanout=2, tunnel="h05")
    leaf = for_cluster(cluster, resolve_all_settings(cluster))["h05"]
    with pytest.raises(TransportError) as info:
        leaf.connect()
    assert "tunnel: true is not supported through a gateway" in info.value.reason
    assert "'h01'" in info.value.reason or "'h02'" in info.value.reason
    assert leaf.probe("true", timed=False).reach_status == "FAIL"


def test_a_leafs_ssh_puts_the_users_options_first_then_batchmode_and_curve25519() -> None:
    text = _file([_ssh_worker("a", "ssh:", "  target: 10.1.1.1", "  port: 2222",
                              "  user: me", "  identity_file: /k/id",
                              "  options: [ConnectTimeout=3, BatchMode=no, "
                              "UserKnownHostsFile=/k/kh]")])
    cluster = parse_cluster(text, file="c.yml", folder="/tmp")
    (w,) = cluster.workers
    argv = leaf_ssh_argv(w, resolve_all_settings(cluster)["a"])
    assert argv[:9] == ["ssh", "-T", "-x", "-p", "2222", "-l", "me", "-i", "/k/id"]
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert opts[:3] == ["ConnectTimeout=3", "BatchMode=no", "UserKnownHostsFile=/k/kh"]
    assert "BatchMode=yes" in opts and opts.index("BatchMode=yes") > 2, \
        "ours come after the user's: OpenSSH keeps the first value"
    assert opts.index("ConnectTimeout=10") > 0, "ours follow; the user's 3 is the one used"
    assert f"KexAlgorithms={LEAF_KEX}" in opts and LEAF_KEX.startswith("curve25519-sha256,")
    assert "StrictHostKeyChecking=accept-new" in opts and "ControlMaster=no" in opts
    assert argv[-2:] == ["--", "10.1.1.1"]


def test_a_leafs_ssh_keeps_the_kex_its_ssh_config_file_sets(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("Host a\n  KexAlgorithms ecdh-sha2-nistp256\n")
    text = _file([_ssh_worker("a", "ssh:", f"  config_file: {config}")])
    cluster = parse_cluster(text, file="c.yml", folder="/tmp")
    argv = leaf_ssh_argv(cluster.workers[0], resolve_all_settings(cluster)["a"])
    assert argv[3:5] == ["-F", str(config)]
    assert not [a for a in argv if a.startswith("KexAlgorithms=")]


# -- the mux framing ---------------------------------------------------------------------------
def test_mux_frames_round_trip_through_the_reader_in_any_pieces() -> None:
    frames = [mux.frame(mux.HELLO, b'{"pid":1}'),
              mux.batch_frame([(1, mux.STDOUT, b"a" * 70000), (2, mux.STDERR, b""),
                               (3, mux.STDOUT, b"\x00\xff")]),
              mux.closed_frame(7, None, 9, "gone")]
    stream = b"login banner\n" + mux.HANDSHAKE + b"".join(frames)
    reader = mux.Reader(mux.UP_TYPES, handshake=True)
    got = []
    at = 0
    rng = random.Random(1)
    while at < len(stream):
        step = rng.randint(1, 9000)
        got += reader.feed(stream[at:at + step])
        at += step
    assert reader.noise == b"login banner\n"
    assert [k for k, _ in got] == [mux.HELLO, mux.BATCH, mux.CLOSED]
    assert mux.parse_batch(got[1][1]) == [(1, 1, b"a" * 70000), (2, 2, b""), (3, 1, b"\x00\xff")]
    lid, rest = mux.parse_leaf(got[2][1])
    assert lid == 7 and mux.parse_json(rest) == {"code": None, "signal": 9, "error": "gone"}


def test_mux_limits_are_errors_as_soon_as_the_header_arrives() -> None:
    reader = mux.Reader(mux.DOWN_TYPES)
    with pytest.raises(mux.MuxError, match="limit"):
        reader.feed((mux.MAX_FRAME + 1).to_bytes(4, "big") + bytes((mux.DATA,)))
    with pytest.raises(mux.MuxError, match="unexpected"):
        mux.Reader(mux.DOWN_TYPES).feed(mux.frame(mux.BATCH))
    with pytest.raises(mux.MuxError, match="version"):
        mux.Reader(mux.UP_TYPES, handshake=True).feed(b"\x00\x00FDL-RELAY/9\n")
    with pytest.raises(mux.MuxError, match="entry"):
        mux.parse_batch(b"\x00\x00\x00\x01\x01\x00\x00\x00\x09abc")
    assert [len(f) for f in mux.data_frames(3, b"x" * (mux.DATA_CHUNK + 1))] == \
        [mux.DATA_CHUNK + 9, 10]


def _agent_stream() -> bytes:
    return (b"motd\n" + wire.HANDSHAKE + wire.message(wire.HELLO, {"pid": 1})
            + wire.output(0, wire.STDOUT, b"x" * 300, False)
            + wire.message(wire.EXITED, {"rank": 0, "code": 1}))


def test_the_frame_watch_sees_an_exit_complete_whatever_the_pieces() -> None:
    stream = _agent_stream()
    for cut in range(1, len(stream)):
        watch = mux.FrameWatch()
        first, second = watch.feed(stream[:cut]), watch.feed(stream[cut:])
        assert not first and second, f"cut at {cut}: the exit ends in the second piece"
    watch = mux.FrameWatch()
    assert not watch.feed(stream[:-1])
    assert watch.feed(stream[-1:])
    assert not mux.FrameWatch().feed(wire.HANDSHAKE + wire.output(0, 1, b"y\n", False))
    broken = mux.FrameWatch()
    assert broken.feed(wire.HANDSHAKE + b"\xff\xff\xff\xff\x45") and broken.broken


# -- batching ----------------------------------------------------------------------------------
def test_a_batch_is_due_50_ms_after_its_oldest_byte_and_carries_every_leaf() -> None:
    b = mux.Batcher()
    for leaf in (1, 2, 3):
        b.open(leaf)
    b.add(1, mux.STDOUT, b"one\n", now=10.0)
    b.add(2, mux.STDERR, b"two\n", now=10.02)
    b.add(3, mux.STDOUT, b"three\n", now=10.04)
    assert not b.due(10.049) and b.due(10.05)
    up = bytearray()
    b.take(up)
    (frame,) = mux.Reader(mux.UP_TYPES).feed(bytes(up))
    assert mux.parse_batch(frame[1]) == [(1, 1, b"one\n"), (2, 2, b"two\n"), (3, 1, b"three\n")]
    assert b.size == 0 and b.wake_at() is None


def test_an_exit_frame_is_flushed_at_once_and_plain_output_waits() -> None:
    b = mux.Batcher()
    b.open(1)
    b.add(1, mux.STDOUT, wire.HANDSHAKE + wire.output(0, 1, b"hi\n", False), now=5.0)
    assert b.wake_at() == pytest.approx(5.05)
    b.add(1, mux.STDOUT, wire.message(wire.EXITED, {"rank": 0, "code": 0})[:6], now=5.01)
    assert not b.due(5.01), "half a frame is not yet an exit"
    b.add(1, mux.STDOUT, wire.message(wire.EXITED, {"rank": 0, "code": 0})[6:], now=5.01)
    assert b.due(5.01)
    up = bytearray()
    b.take(up)
    assert not b.due(100.0)


def test_heartbeats_alone_wait_half_a_second_and_output_pulls_them_forward() -> None:
    """At 1,024 hosts the agents' heartbeats alone made every relay send 20 batches a
    second; a batch of nothing but heartbeats may wait `LAZY_INTERVAL`."""
    b = mux.Batcher()
    b.open(1)
    b.open(2)
    b.add(1, mux.STDOUT, wire.HANDSHAKE, now=1.0)  # the handshakes: not lazy frames
    b.add(2, mux.STDOUT, wire.HANDSHAKE, now=1.0)
    up = bytearray()
    b.take(up)
    b.add(1, mux.STDOUT, wire.message(wire.HEARTBEAT), now=2.0)
    assert b.wake_at() == pytest.approx(2.0 + mux.LAZY_INTERVAL)
    b.add(2, mux.STDOUT, wire.message(wire.HEARTBEAT)[:3], now=2.1)
    assert b.wake_at() == pytest.approx(2.0 + mux.LAZY_INTERVAL), "half a heartbeat is lazy"
    b.add(1, mux.STDOUT, wire.output(0, 1, b"a line\n", False), now=2.2)
    assert b.wake_at() == pytest.approx(2.2 + mux.BATCH_INTERVAL), "output does not wait"


def test_batches_keep_each_leafs_bytes_exact_and_in_order() -> None:
    rng = random.Random(7)
    b = mux.Batcher()
    sent: dict[tuple[int, int], bytearray] = {}
    for leaf in range(1, 6):
        b.open(leaf)
    now = 0.0
    received: dict[tuple[int, int], bytearray] = {}
    reader = mux.Reader(mux.UP_TYPES)
    for _ in range(2000):
        leaf, stream = rng.randint(1, 5), rng.choice((1, 2))
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 3000)))
        sent.setdefault((leaf, stream), bytearray()).extend(data)
        now += 0.001
        b.add(leaf, stream, data, now)
        if b.due(now):
            up = bytearray()
            b.take(up, limit=rng.choice((None, 1, 50_000)))
            for _, body in reader.feed(bytes(up)):
                for lid, s, chunk in mux.parse_batch(body):
                    received.setdefault((lid, s), bytearray()).extend(chunk)
    up = bytearray()
    b.take(up)
    for _, body in reader.feed(bytes(up)):
        for lid, s, chunk in mux.parse_batch(body):
            received.setdefault((lid, s), bytearray()).extend(chunk)
    assert received == sent


def test_one_busy_leaf_does_not_hold_the_others_back_and_frames_stay_bounded() -> None:
    b = mux.Batcher()
    b.open(1)
    b.open(2)
    b.add(1, mux.STDOUT, b"x" * (3 * mux.BATCH_MAX), now=0.0)
    b.add(2, mux.STDOUT, b"quiet\n", now=0.0)
    up = bytearray()
    b.take(up, limit=1)  # one round only: the launcher is behind
    (first,) = mux.Reader(mux.UP_TYPES).feed(bytes(up))
    entries = mux.parse_batch(first[1])
    assert entries[0] == (1, 1, b"x" * mux.ENTRY_MAX) and entries[1] == (2, 1, b"quiet\n")
    assert b.backlog(1) == 3 * mux.BATCH_MAX - mux.ENTRY_MAX and b.backlog(2) == 0
    up = bytearray()
    b.take(up)
    assert all(len(body) <= mux.BATCH_MAX + mux.ENTRY_MAX
               for _, body in mux.Reader(mux.UP_TYPES).feed(bytes(up)))


# -- the relay process, over pipes -------------------------------------------------------------
class RelayProc:
    """A relay run from this checkout (``setup`` may patch its bounds first)."""

    def __init__(self, setup: str = "", bootstrap: bool = False) -> None:
        if bootstrap:
            argv = [sys.executable, "-I", "-S", "-c", bundle.BOOTSTRAP, "relay"]
        else:
            code = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" \
                f"import fdl_fabric.agent.relay as r\n{setup}\nsys.exit(r.main())"
            argv = [sys.executable, "-c", code]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, bufsize=0)
        if bootstrap:
            self.write(bundle.payload())
        self.reader = mux.Reader(mux.UP_TYPES, handshake=True)
        self.frames: list[tuple[int, bytes]] = []
        self.out: dict[tuple[int, int], bytearray] = {}
        self.closed: dict[int, dict[str, Any]] = {}
        self.batches = 0
        self.until(lambda: any(k == mux.HELLO for k, _ in self.frames))

    def write(self, *frames: bytes) -> None:
        assert self.proc.stdin is not None
        for f in frames:
            self.proc.stdin.write(f)

    def pump(self, timeout: float) -> bool:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return True
        data = os.read(self.proc.stdout.fileno(), 1 << 20)
        if not data:
            return False
        for kind, body in self.reader.feed(data):
            self.frames.append((kind, body))
            if kind == mux.BATCH:
                self.batches += 1
                for lid, stream, chunk in mux.parse_batch(body):
                    self.out.setdefault((lid, stream), bytearray()).extend(chunk)
            elif kind == mux.CLOSED:
                lid, rest = mux.parse_leaf(body)
                self.closed[lid] = mux.parse_json(rest)
        return True

    def until(self, done: Any, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < end, f"timed out; frames so far: {self.frames[-5:]}"
            if not self.pump(0.05) and not done():
                raise AssertionError("the relay's stdout ended")

    def text(self, lid: int, stream: int = mux.STDOUT) -> bytes:
        return bytes(self.out.get((lid, stream), b""))

    def finish(self, timeout: float = 20.0) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        end = time.monotonic() + timeout
        while self.pump(0.05):
            assert time.monotonic() < end, "the relay did not end"
        return self.proc.wait(timeout)


@pytest.fixture
def relays() -> Any:
    made: list[RelayProc] = []

    def make(*args: Any, **kwargs: Any) -> RelayProc:
        r = RelayProc(*args, **kwargs)
        made.append(r)
        return r

    yield make
    for r in made:
        if r.proc.poll() is None:
            r.proc.kill()
        r.proc.wait(10)


def test_a_leaf_gets_its_bytes_and_eof_and_its_exit_status_comes_after_its_output(
        relays: Any) -> None:
    r = relays()
    r.write(mux.open_frame(1, ["sh", "-c", "cat; echo bye >&2; exit 3"]),
            *mux.data_frames(1, b"hello\n"), mux.leaf_frame(mux.EOF, 1))
    r.until(lambda: 1 in r.closed)
    assert r.text(1) == b"hello\n" and r.text(1, mux.STDERR) == b"bye\n"
    assert r.closed[1] == {"code": 3, "signal": None, "error": ""}
    kinds = [k for k, _ in r.frames]
    assert kinds.index(mux.CLOSED) > max(i for i, k in enumerate(kinds) if k == mux.BATCH)
    assert r.finish() == 0


def test_kill_a_leaf_and_a_leaf_that_cannot_start(relays: Any) -> None:
    r = relays()
    r.write(mux.open_frame(1, ["sleep", "100"]), mux.leaf_frame(mux.KILL, 1),
            mux.open_frame(2, ["/nonexistent/ssh", "x"]))
    r.until(lambda: {1, 2} <= set(r.closed))
    assert r.closed[1]["signal"] == 9
    assert r.closed[2]["code"] is None and "cannot start /nonexistent/ssh" in r.closed[2]["error"]
    r.write(*mux.data_frames(1, b"late\n"), mux.leaf_frame(mux.EOF, 2))  # ignored: ended
    assert r.finish() == 0


def test_the_relays_eof_closes_every_leafs_stdin_and_it_exits_when_they_end(
        relays: Any, tmp_path: Path) -> None:
    r = relays()
    marks = [tmp_path / f"eof{i}" for i in range(3)]
    for i, mark in enumerate(marks):
        r.write(mux.open_frame(i + 1, ["sh", "-c", f"cat >/dev/null; touch {mark}"]))
    assert r.finish() == 0
    assert all(m.exists() for m in marks), "each leaf saw EOF on its stdin (the leash)"
    assert sorted(r.closed) == [1, 2, 3]


def test_leaves_that_ignore_the_leash_are_killed_after_the_bound(relays: Any) -> None:
    r = relays("r.DRAIN_BOUND = 0.3; r.KILL_AFTER = 0.3")
    r.write(mux.open_frame(1, ["sh", "-c", "trap '' TERM; exec sleep 100"]))
    time.sleep(0.2)
    t0 = time.monotonic()
    assert r.finish() == 0
    assert time.monotonic() - t0 < 5
    assert r.closed[1]["signal"] == 9


def test_the_agent_payload_goes_to_the_relay_once_and_starts_real_agents(relays: Any) -> None:
    r = relays(bootstrap=True)
    agent = ["sh", "-c", bundle.local_command(sys.executable)]
    r.write(mux.frame(mux.BLOB, bundle.payload()))
    for lid in (1, 2):
        r.write(mux.open_frame(lid, agent), mux.leaf_frame(mux.PAYLOAD, lid))
    r.until(lambda: all(wire.HANDSHAKE in r.text(lid) for lid in (1, 2)))
    for lid in (1, 2):
        frames = wire.Reader(wire.UP_TYPES, handshake=True).feed(r.text(lid))
        assert frames[0][0] == wire.HELLO
    assert r.finish() == 0
    for lid in (1, 2):  # the relay's EOF reached each agent: it said done and exited 0
        assert r.closed[lid]["code"] == 0
        assert wire.DONE in [k for k, _ in wire.Reader(wire.UP_TYPES, handshake=True)
                             .feed(r.text(lid))]


def test_a_relay_whose_launcher_does_not_read_stops_reading_its_leaves(
        relays: Any, tmp_path: Path) -> None:
    r = relays()
    size = 24 * 1024 * 1024  # > LEAF_HIGH + UP_HIGH + pipe buffers
    done = tmp_path / "done"
    script = (f"import sys, os; w = sys.stdout.buffer; "
              f"[w.write(bytes([i % 251]) * 65536) for i in range({size // 65536})]; "
              f"w.flush(); open({str(done)!r}, 'w').close()")
    r.write(mux.open_frame(1, [sys.executable, "-c", script]))
    time.sleep(2.0)
    assert not done.exists(), "the leaf is held back, not buffered without bound"
    r.until(lambda: 1 in r.closed, timeout=60)
    expected = b"".join(bytes([i % 251]) * 65536 for i in range(size // 65536))
    assert r.text(1) == expected
    assert done.exists()
    assert r.finish() == 0


def test_a_broken_downstream_frame_is_reported_and_every_leaf_let_go(relays: Any) -> None:
    r = relays()
    r.write(mux.open_frame(1, ["sh", "-c", "cat >/dev/null"]), mux.frame(mux.OPEN, b"\x00"))
    r.until(lambda: any(k == mux.ERROR for k, _ in r.frames))
    (said,) = [mux.parse_json(b)["message"] for k, b in r.frames if k == mux.ERROR]
    assert "protocol error" in said
    r.until(lambda: 1 in r.closed)
    assert r.proc.wait(10) == mux.EXIT_PROTOCOL


# -- the launcher's end of a relay -------------------------------------------------------------
class FakeRunner:
    def __init__(self) -> None:
        self.written = bytearray()
        self.eof = False

    def _write_proc_stdin(self, data: bytes) -> None:
        self.written += data

    def close_proc_stdin(self) -> None:
        self.eof = True

    def kill(self) -> None:
        self.eof = True


class Sink:
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = 0

    def feed(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        self.closed += 1


def _relay() -> tuple[Relay, FakeRunner]:
    relay = Relay("gw", None)
    runner = FakeRunner()
    relay.runner = runner
    relay._feed(b"noise" + mux.HANDSHAKE + mux.frame(mux.HELLO, b'{"pid": 42}'))
    assert relay.running and relay.pid == 42
    return relay, runner


def test_the_launcher_demultiplexes_batches_into_each_leafs_sinks() -> None:
    relay, runner = _relay()
    sinks = {lid: (Sink(), Sink()) for lid in (1, 2)}
    agents = {lid: relay.open(f"leaf{lid}", ["ssh", "x"], *sinks[lid]) for lid in (1, 2)}
    stream = (mux.batch_frame([(1, 1, b"a1"), (2, 2, b"b-err"), (1, 1, b"a2")])
              + mux.closed_frame(1, 0, None) + mux.batch_frame([(2, 1, b"b1")]))
    for i in range(len(stream)):  # one byte at a time
        relay._feed(stream[i:i + 1])
    assert sinks[1][0].data == b"a1a2" and sinks[2][1].data == b"b-err"
    assert sinks[2][0].data == b"b1"
    assert agents[1].exit_status(0) == 0 and sinks[1][0].closed == sinks[1][1].closed == 1
    assert agents[2].exit_status(0.01) is None and not sinks[2][0].closed
    frames = mux.Reader(mux.DOWN_TYPES).feed(bytes(runner.written))
    opened = [json.loads(mux.parse_leaf(b)[1])["argv"] for k, b in frames if k == mux.OPEN]
    assert opened == [["ssh", "x"], ["ssh", "x"]]


def test_the_payload_goes_once_per_relay_and_writes_become_frames() -> None:
    relay, runner = _relay()
    a = relay.open("a", ["ssh", "a"], Sink(), Sink())
    b = relay.open("b", ["ssh", "b"], Sink(), Sink())
    a.write(bundle.payload())
    b.write(bundle.payload())
    a.write(wire.message(wire.PING))
    a.close_input()
    b.kill()
    frames = mux.Reader(mux.DOWN_TYPES).feed(bytes(runner.written))
    kinds = [k for k, _ in frames]
    assert kinds == [mux.OPEN, mux.OPEN, mux.BLOB, mux.PAYLOAD, mux.PAYLOAD, mux.DATA,
                     mux.EOF, mux.KILL]
    assert frames[2][1] == bundle.payload()
    assert mux.parse_leaf(frames[5][1]) == (a.id, wire.message(wire.PING))


def test_a_relay_that_ends_loses_every_leaf_with_a_reason_naming_the_gateway() -> None:
    relay, _ = _relay()
    sinks = (Sink(), Sink())
    agent = relay.open("leaf", ["ssh", "x"], *sinks)
    relay._stderr = b"Traceback ...\nboom\n"
    relay._stream_closed()
    relay._stream_closed()
    assert agent.exit_status(0) is None and sinks[0].closed == 1
    assert agent.lost_reason.startswith("lost with its gateway 'gw': the gateway's connection")
    assert "its last words: boom" in agent.lost_reason
    with pytest.raises(TransportError, match="gateway 'gw' has no relay running"):
        relay.open("late", ["ssh"], Sink(), Sink())


def test_a_relay_that_breaks_the_mux_is_cut_and_says_so() -> None:
    relay, runner = _relay()
    agent = relay.open("leaf", ["ssh", "x"], Sink(), Sink())
    relay._feed(mux.frame(mux.OPEN, b"x"))  # a type the relay never sends
    assert runner.eof
    relay._stream_closed()
    relay._stream_closed()
    assert "protocol error from the relay" in agent.lost_reason


def test_a_dry_run_shows_the_tree_that_fanout_gives(tmp_path: Path) -> None:
    """``--fanout`` (over the file's ``fanout:``) and the dry run: which gateway starts
    which leaves, nothing connected (documentation-only loopback targets)."""
    from labutil import INV_LAUNCH

    workers = "".join(f"  - {{host: node{i}, path: /tmp, nproc: 1, "
                      f"ssh: {{target: 127.0.0.{i + 10}}}}}\n" for i in range(1, 11))
    cluster = tmp_path / "c.yml"
    cluster.write_text("controller: {host: 127.0.0.1, port: 23555}\ncommand: python3 -c pass\n"
                       "fanout: 64\nworkers:\n" + workers)
    done = subprocess.run([*INV_LAUNCH, "-c", str(cluster), "--dry-run", "--fanout", "3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "gateway tree (fanout 3): the launcher connects to 3 gateway(s)" in done.stdout
    assert "  node1 -> 3 leaves: node4, node5, node6" in done.stdout
    assert "host node9: host node9 via gateway node3: ssh 127.0.0.19 from there" in done.stdout
    flat = subprocess.run([*INV_LAUNCH, "-c", str(cluster), "--dry-run"],
                          capture_output=True, text=True, timeout=60)
    assert "gateway tree" not in flat.stdout
    bad = subprocess.run([*INV_LAUNCH, "-c", str(cluster), "--fanout", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "--fanout: expected a whole number from 1 to 1024, got '0'"


def test_lease_renewals_to_a_gateways_leaves_go_in_one_write_and_keep_each_leafs_order(
        ) -> None:
    relay, runner = _relay()

    class Counting(FakeRunner):
        writes = 0

        def _write_proc_stdin(self, data: bytes) -> None:
            Counting.writes += 1
            super()._write_proc_stdin(data)

    runner = relay.runner = Counting()
    ping = wire.message(wire.PING)
    for lid in (1, 2, 3):
        relay.send_lazy(lid, ping)
    assert Counting.writes == 0, "they wait a moment for the others"
    time.sleep(gateway.LAZY_WRITE_DELAY * 5)
    assert Counting.writes == 1
    assert bytes(runner.written) == b"".join(mux.leaf_frame(mux.DATA, lid, ping)
                                             for lid in (1, 2, 3))
    runner.written.clear()
    relay.send_lazy(1, ping)
    relay.send_data(1, b"stop")  # a write that must not pass the ping before it
    assert bytes(runner.written) == (mux.leaf_frame(mux.DATA, 1, ping)
                                     + mux.leaf_frame(mux.DATA, 1, b"stop"))
