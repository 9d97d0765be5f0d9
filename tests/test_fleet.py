"""The fleet pre-flight's rules (who dials whom, what a failure says, which interface to
suggest) and the agent's listener and dials over real sockets on this machine."""

from __future__ import annotations

import json
import selectors
import socket
from typing import Any, Optional

from fdl_fabric.agent import fleet, wire
from fdl_fabric.preflight import matrix, nic
from fdl_fabric.preflight.probe import IfnameSetting
from fdl_fabric.preflight.report import CONTROLLER, Check, Status


def _peers(n: int) -> list[matrix.Peer]:
    return [matrix.Peer(f"h{i}", f"10.0.0.{i + 1}") for i in range(n)]


def _listening(peers: list[matrix.Peer], master: str = "h0") -> dict[str, dict[str, Any]]:
    return {p.host: {"ports": {"29500": "ok"} if p.host == master else {},
                     "ephemeral": [40000, 40001], "ifaces": {}} for p in peers}


def test_up_to_fanout_every_pair_is_dialed_on_every_sampled_port_and_master_port() -> None:
    peers = _peers(4)
    targets = matrix.dials(peers, _listening(peers), "h0", "10.0.0.1", 29500, fanout=64)
    for p in peers:
        ephemeral = {(t.host, t.port) for t in targets[p.host] if t.purpose == "ephemeral"}
        assert ephemeral == {(q.host, port) for q in peers if q != p for port in (40000, 40001)}
        assert [t.port for t in targets[p.host] if t.purpose == "master"] == \
            ([] if p.host == "h0" else [29500])


def test_beyond_fanout_every_host_is_dialed_by_at_least_ring_peers_and_dials_as_many() -> None:
    peers = _peers(40)
    targets = matrix.dials(peers, _listening(peers), "h0", "10.0.0.1", 29500, fanout=8,
                           seed="run")
    dialed_by: dict[str, set[str]] = {}
    for dialer, ts in targets.items():
        for t in ts:
            if t.purpose == "ephemeral":
                dialed_by.setdefault(t.host, set()).add(dialer)
        assert len({t.host for t in ts if t.purpose == "ephemeral"}) >= matrix.RING
        assert any(t.purpose == "master" for t in ts) or dialer == "h0"
    assert all(len(d) >= matrix.RING for d in dialed_by.values()) and len(dialed_by) == 40
    # far fewer dials than every pair
    assert sum(len(ts) for ts in targets.values()) < 40 * 39


def test_a_failed_pair_is_named_with_its_port_and_cause_and_nothing_else() -> None:
    peers = _peers(3)
    targets = matrix.dials(peers, _listening(peers), "h0", "10.0.0.1", 29500, fanout=64)
    results = {h: {t.id: "ok" for t in ts} for h, ts in targets.items()}
    results["h2"]["m:h2"] = "!timed out after 2 s"
    rows = matrix.judge(targets, results, 1.0, sampled=False)
    assert rows == [Check("h2", "reach", Status.FAIL,
                          "h2 cannot reach h0:29500 at 10.0.0.1 (MASTER_ADDR) "
                          "(timed out after 2 s)")]


def test_a_host_nobody_reaches_is_said_once_not_once_per_peer() -> None:
    peers = _peers(4)
    targets = matrix.dials(peers, _listening(peers), "h0", "10.0.0.1", 29500, fanout=64)
    results = {h: {t.id: ("!No route to host" if t.host == "h3" else "ok") for t in ts}
               for h, ts in targets.items()}
    rows = matrix.judge(targets, results, 1.0, sampled=False)
    assert [r.host for r in rows] == ["h3", "h3"]  # one row per sampled port
    assert all(r.reason.startswith("no host reaches h3:4000") for r in rows)


def test_a_host_that_reaches_nobody_is_said_once() -> None:
    peers = _peers(4)
    targets = matrix.dials(peers, _listening(peers), "h0", "10.0.0.1", 29500, fanout=64)
    results = {h: {t.id: ("!Network is unreachable" if h == "h1" else "ok") for t in ts}
               for h, ts in targets.items()}
    rows = matrix.judge(targets, results, 1.0, sampled=False)
    assert rows == [Check("h1", "reach", Status.FAIL,
                          "h1 reaches no other host (h0:29500 at 10.0.0.1 (MASTER_ADDR): "
                          "Network is unreachable): its link or firewall")]


def test_when_everything_answers_one_row_says_so() -> None:
    peers = _peers(2)
    targets = matrix.dials(peers, _listening(peers), "h0", "10.0.0.1", 29500, fanout=64)
    results = {h: {t.id: "ok" for t in ts} for h, ts in targets.items()}
    [row] = matrix.judge(targets, results, 0.4, sampled=False)
    assert row.host == CONTROLLER and row.status is Status.OK
    assert row.reason.startswith("5 dials between 2 hosts (every pair)")


def test_master_port_taken_on_rank_0s_host_fails_before_any_dial() -> None:
    rows = matrix.listen_rows("h0", 29500, {"h0": {"ports": {"29500": "!in use on this host"}}})
    assert rows == [Check("h0", "reach", Status.FAIL,
                          "master_port 29500 in use on this host: rank 0's store cannot "
                          "listen there (give --master-port, or master_port:)")]


def test_nccl_reads_prefixes_and_gloo_exact_names() -> None:
    nccl, gloo = IfnameSetting("NCCL_SOCKET_IFNAME", "eth", "x"), \
        IfnameSetting("GLOO_SOCKET_IFNAME", "eth", "x")
    assert nccl.matches("eth0") and not gloo.matches("eth0") and gloo.matches("eth")
    assert IfnameSetting("NCCL_SOCKET_IFNAME", "=eth0", "x").matches("eth0")
    assert not IfnameSetting("NCCL_SOCKET_IFNAME", "=eth0", "x").matches("eth01")
    assert IfnameSetting("NCCL_SOCKET_IFNAME", "^docker", "x").excludes_only


def _plan(ifnames: tuple[IfnameSetting, ...]) -> Any:
    from fdl_fabric.clusterfile import parse_cluster
    from fdl_fabric.preflight.probe import HostPlan

    doc = {"workers": [{"host": "gpu1", "path": "/srv", "nproc": 1}]}
    worker = parse_cluster(json.dumps(doc), file="c.yml", folder="/proj",
                           local_hostname="ctl").workers[0]
    return HostPlan(worker=worker, fast=True, argv=("true",), ifnames=ifnames)


def test_an_interface_that_is_down_or_has_no_address_fails_on_its_host() -> None:
    from fdl_fabric.preflight.facts import ControllerFacts, HostFacts

    setting = IfnameSetting("NCCL_SOCKET_IFNAME", "eth1", "nccl_socket_ifname")
    plan = _plan((setting,))
    ifaces = {"lo": {"up": True, "addrs": ["127.0.0.1"]}, "eth1": {"up": False, "addrs": []}}
    [row] = nic.iface_row(plan, HostFacts({"ifaces": json.dumps(ifaces)}), ControllerFacts())
    assert row.status is Status.FAIL and "eth1 is down" in row.reason
    ifaces["eth1"]["up"] = True
    [row] = nic.iface_row(plan, HostFacts({"ifaces": json.dumps(ifaces)}), ControllerFacts())
    assert row.status is Status.FAIL and "eth1 has no IPv4 address" in row.reason


def test_with_a_setting_an_address_a_peer_cannot_reach_is_named_with_the_peer() -> None:
    setting = IfnameSetting("NCCL_SOCKET_IFNAME", "eth1", "nccl_socket_ifname")
    rows = nic.reach_rows("gpu-a", (setting,),
                          {("eth1", "10.1.0.1"): [("gpu-c", "timed out after 2 s")]})
    assert rows == [Check("gpu-a", "nic", Status.FAIL,
                          "nccl_socket_ifname eth1: eth1 10.1.0.1 is not reached from gpu-c "
                          "(timed out after 2 s): the ranks there cannot connect to this "
                          "host's ranks")]


def test_with_no_interface_reached_by_every_peer_the_host_fails() -> None:
    rows = nic.reach_rows("gpu-a", (), {("eth0", "10.0.0.1"): [("gpu-b", "refused")],
                                        ("eth1", "10.1.0.1"): [("gpu-b", "refused")]})
    assert [r.status for r in rows] == [Status.FAIL]


# -- the agent's side, over real sockets -------------------------------------------------


class _Agent:
    """A FleetCheck with the agent's selector, its frames kept."""

    def __init__(self, host: str) -> None:
        self.sel = selectors.DefaultSelector()
        self.sent: list[dict[str, Any]] = []
        self.check = fleet.FleetCheck(self._send, self.sel)
        self.host = host

    def _send(self, kind: int, body: Optional[dict[str, Any]]) -> None:
        assert kind == wire.FACTS and body is not None
        self.sent.append(body["fleet"])

    def ask(self, **request: Any) -> dict[str, Any]:
        self.check.on_request(request, beat=lambda s: None)
        return self.sent[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_agents_reach_each_others_listener_and_prove_who_answered() -> None:
    a, b = _Agent("a"), _Agent("b")
    token = "ab" * 16
    port = _free_port()
    got = a.ask(op="listen", host="a", token=token, ports=[port], ephemeral=1)
    assert got["ports"] == {str(port): "ok"} and len(got["ephemeral"]) == 1
    assert "lo" in got["ifaces"]
    b.ask(op="listen", host="b", token=token, ports=[], ephemeral=0)
    # b dials a: a's listener answers from a's own loop, as the agent's select would
    import threading

    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            a.check.serve(0.05)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        done = b.ask(op="dial", timeout=2.0, targets=[
            {"id": "1", "host": "a", "addr": "127.0.0.1", "port": port},
            {"id": "2", "host": "z", "addr": "127.0.0.1", "port": port},
            {"id": "3", "host": "a", "addr": "127.0.0.1", "port": _free_port()}])
    finally:
        stop.set()
        t.join()
    assert done["dialed"]["1"] == "ok"
    assert done["dialed"]["2"] == "?answered as a, not z"
    assert done["dialed"]["3"] == "!Connection refused"
    a.ask(op="close")
    with socket.socket() as s:  # released: the job can bind it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))


def test_a_listener_answers_nothing_to_a_probe_without_the_checks_key() -> None:
    a = _Agent("a")
    port = _free_port()
    a.ask(op="listen", host="a", token="ab" * 16, ports=[port], ephemeral=0)
    from fdl_fabric import rank

    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(rank.encode_frame(b"wrong" * 4, fleet.FLEET_RUN, 0, {"type": "probe"}))
        for _ in range(20):
            a.check.serve(0.05)
        s.settimeout(2)
        assert s.recv(100) == b""  # dropped without a reply
    a.ask(op="close")


def test_a_port_already_taken_is_reported_never_taken_over() -> None:
    a = _Agent("a")
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        got = a.ask(op="listen", host="a", token="ab" * 16, ports=[port], ephemeral=0)
    assert got["ports"] == {str(port): "!in use on this host"}
    a.ask(op="close")


def test_smoke_without_the_preflight_is_refused_naming_both_flags() -> None:
    import pytest

    import fdl_fabric
    from fdl_fabric.errors import FdlError

    with pytest.raises(FdlError) as caught:
        fdl_fabric.launch(None, "true", hosts="a", smoke=True, preflight=False)
    assert caught.value.exit_code == 2
    assert str(caught.value).startswith("--smoke: it is part of the pre-flight, which "
                                        "--no-preflight turns off")
