"""The join window's rules (docs/join.md): admission, flodl's order of verdicts, the
rank order, and the cluster file's ``controller.join`` refused where it contradicts
itself. Pure: no socket, no clock."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fdl_fabric.clusterfile import ConfigError, JoinSpec, StartMode, load_cluster
from fdl_fabric.planning.joinwindow import Decision, JoinLedger, Offer, Why, WindowState

RUN = "20261206-000000-abcdef12"


def ledger(*, quorum: int = 2, target: Optional[int] = None, window: float = 10.0,
           cap: float = 20.0, start: StartMode = StartMode.AUTO, discovery: bool = True,
           roster: Optional[dict[str, int]] = None, per_host: int = 8) -> JoinLedger:
    spec = JoinSpec(min_ranks=quorum, target_ranks=target, join_timeout=window,
                    max_join_timeout=cap, discovery=discovery, start=start,
                    max_ranks_per_host=per_host)
    return JoinLedger(spec, RUN, roster or {})


def walk_in(host: str, nproc: int = 1, **kw: object) -> Offer:
    return Offer(host=host, nproc=nproc, **kw)  # type: ignore[arg-type]


# -- admission ---------------------------------------------------------------------------

def test_a_duplicate_host_name_is_refused_and_the_first_stays_in() -> None:
    window = ledger()
    assert window.admit(walk_in("pod-a")) is None
    refused = window.admit(walk_in("pod-a"))
    assert refused is not None and refused.permanent
    assert "already joined this run" in refused.reason
    assert window.ranks_in == 1


@pytest.mark.parametrize("offer,said", [
    (Offer(host="", nproc=1), "no host name"),
    (Offer(host="pod\x1b[2Ja", nproc=1), "not one"),
    (Offer(host="pod-a", nproc=1, run_id="another-run"), "started for run"),
    (Offer(host="pod-a", nproc=9), "more than the window's max_ranks_per_host (8)"),
    (Offer(host="pod-a", nproc=0), "offers no ranks"),
    (Offer(host="pod-a", devices=(0, 0)), "a device is offered twice"),
])
def test_an_offer_that_cannot_join_is_refused_with_its_reason(offer: Offer, said: str) -> None:
    window = ledger()
    refused = window.admit(offer)
    assert refused is not None and said in refused.reason and refused.permanent
    assert window.joined == {}


def test_without_discovery_only_the_rosters_joiners_are_admitted_with_the_files_count() -> None:
    window = ledger(discovery=False, roster={"gpu-a": 2})
    refused = window.admit(walk_in("stranger"))
    assert refused is not None and "not in the cluster file's workers" in refused.reason
    contradicted = window.admit(walk_in("gpu-a", nproc=4))
    assert contradicted is not None and "gives 'gpu-a' 2 rank(s), it offers 4" in \
        contradicted.reason
    assert window.admit(Offer(host="gpu-a")) is None  # no count offered: the file's
    assert window.ranks_in == 2


def test_a_joiner_that_leaves_before_the_world_forms_no_longer_counts() -> None:
    window = ledger(quorum=2, target=2)
    window.admit(walk_in("pod-a"))
    window.retract("pod-a")
    window.admit(walk_in("pod-b"))
    assert window.decide(0.0).state is WindowState.OPEN


def test_once_formed_nobody_else_is_admitted_and_it_may_dial_the_next_window() -> None:
    window = ledger(quorum=1, target=1)
    window.admit(walk_in("pod-a"))
    assert window.decide(0.0) == Decision(WindowState.FORMED, Why.TARGET_REACHED)
    late = window.admit(walk_in("pod-b"))
    assert late is not None and not late.permanent and "the world has formed" in late.reason


# -- flodl's order of verdicts -------------------------------------------------------------

def test_the_target_closes_the_window_early() -> None:
    window = ledger(quorum=2, target=3)
    for host in ("a", "b"):
        window.admit(walk_in(host))
    assert window.decide(1.0).state is WindowState.OPEN, "a quorum early does not close it"
    window.admit(walk_in("c"))
    assert window.decide(1.0) == Decision(WindowState.FORMED, Why.TARGET_REACHED)


def test_the_window_closes_with_its_quorum_when_its_time_is_up() -> None:
    window = ledger(quorum=2, target=4)
    for host in ("a", "b"):
        window.admit(walk_in(host))
    assert window.decide(10.0) == Decision(WindowState.FORMED, Why.WINDOW_CLOSED)


def test_a_quorum_unmet_at_the_cap_fails_and_not_before() -> None:
    window = ledger(quorum=3)
    window.admit(walk_in("a"))
    assert window.decide(19.9).state is WindowState.OPEN, "the grace until the cap"
    assert window.decide(20.0) == Decision(WindowState.FAILED, Why.QUORUM_NOT_MET)


def test_manual_waits_for_the_operator_and_fails_at_the_cap_without_one() -> None:
    window = ledger(quorum=1, start=StartMode.MANUAL)
    assert window.arm() is not None and "quorum not met (0/1" in str(window.arm())
    window.admit(walk_in("a"))
    assert window.decide(15.0).state is WindowState.OPEN, "manual never closes by itself"
    assert window.decide(20.0) == Decision(WindowState.FAILED, Why.START_NOT_RECEIVED)


def test_the_operators_start_forms_a_manual_window_at_once() -> None:
    window = ledger(quorum=1, start=StartMode.MANUAL)
    window.admit(walk_in("a"))
    assert window.arm() is None
    assert window.decide(0.1) == Decision(WindowState.FORMED, Why.OPERATOR_START)


def test_an_auto_window_refuses_the_operators_start() -> None:
    window = ledger(quorum=1)
    window.admit(walk_in("a"))
    assert "auto" in str(window.arm())


@given(quorum=st.integers(1, 6), target=st.one_of(st.none(), st.integers(1, 8)),
       joined=st.integers(0, 8), elapsed=st.floats(0, 40), armed=st.booleans(),
       start=st.sampled_from(list(StartMode)))
def test_the_verdict_follows_flodls_order(quorum: int, target: Optional[int], joined: int,
                                          elapsed: float, armed: bool,
                                          start: StartMode) -> None:
    """Formed only with the quorum in; failed only at the cap; under manual, only the
    operator forms it; a target forms it the moment it is in (not under manual)."""
    if target is not None and (target < quorum or start is StartMode.MANUAL):
        target = None
    window = ledger(quorum=quorum, target=target, start=start, per_host=8)
    for n in range(joined):
        window.admit(walk_in(f"pod-{n}"))
    window.armed = armed
    decision = window.decide(elapsed)
    if decision.state is WindowState.FORMED:
        assert joined >= quorum
        if start is StartMode.MANUAL:
            assert decision.why is Why.OPERATOR_START
        if decision.why is Why.WINDOW_CLOSED:
            assert elapsed >= 10.0
    elif decision.state is WindowState.FAILED:
        assert elapsed >= 20.0
    else:
        assert elapsed < 20.0
    if target is not None and joined >= target and start is not StartMode.MANUAL:
        assert decision.state is WindowState.FORMED


def test_ranks_are_numbered_roster_first_then_walk_ins_by_name() -> None:
    window = ledger(roster={"gpu-b": 1, "gpu-a": 1})
    for host in ("zeta", "gpu-a", "alpha", "gpu-b"):
        window.admit(walk_in(host))
    assert window.ordered_hosts(["gpu-b", "gpu-a"]) == ["gpu-b", "gpu-a", "alpha", "zeta"]


# -- the cluster file ----------------------------------------------------------------------

def load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "cluster.yml"
    path.write_text(text)
    return load_cluster(str(path))


def problems(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    assert caught.value.exit_code == 2
    return str(caught.value)


def test_a_discovery_window_needs_no_workers_but_a_quorum(tmp_path: Path) -> None:
    cluster = load(tmp_path, "controller:\n  join:\n    discovery: true\n    min_ranks: 4\n")
    join = cluster.controller.join  # type: ignore[attr-defined]
    assert cluster.workers == () and join.min_ranks == 4  # type: ignore[attr-defined]
    assert join.target_ranks is None and join.join_timeout == 300 and \
        join.max_join_timeout == 600 and join.port == 1338
    said = problems(tmp_path, "controller:\n  join:\n    discovery: true\n")
    assert "cluster.yml:3: controller.join: discovery: true needs min_ranks" in said


def test_contradictions_in_the_window_are_refused_each_with_its_line(tmp_path: Path) -> None:
    said = problems(tmp_path, """\
controller:
  join:
    discovery: true
    start: manual
    min_ranks: 3
    target_ranks: 2
    join_timeout: 50
    max_join_timeout: 10
    quorom: 1
""")
    assert "cluster.yml:6: controller.join.target_ranks: start: manual waits for " \
        "`fdl-fabric start`" in said
    assert "target_ranks (2) is below min_ranks (3)" in said
    assert "cluster.yml:8: controller.join.max_join_timeout: max_join_timeout (10s) must " \
        "be at least join_timeout (50s)" in said
    assert "cluster.yml:9: controller.join.quorom: unknown key" in said


def test_a_roster_joiner_gives_the_window_its_capacity(tmp_path: Path) -> None:
    cluster = load(tmp_path, """\
controller:
  join: {}
workers:
  - {host: gpu-a, transport: join, nproc: 2}
  - {host: gpu-b, transport: join, local_devices: [0, 1, 2]}
""")
    join = cluster.controller.join  # type: ignore[attr-defined]
    assert (join.min_ranks, join.target_ranks) == (5, 5)
    assert [w.path for w in cluster.workers] == ["", ""], "a joiner says its folder"


def test_a_joiner_without_a_window_is_refused_at_its_transport(tmp_path: Path) -> None:
    said = problems(tmp_path, "workers:\n  - {host: gpu-a, transport: join, nproc: 1}\n")
    assert "workers[0].transport: a worker that joins (transport: join) needs a join " \
        "window" in said


def test_a_token_file_that_is_not_there_is_refused_at_its_key(tmp_path: Path) -> None:
    said = problems(tmp_path, "controller:\n  join:\n    discovery: true\n    min_ranks: 1\n"
                    "    token_file: nowhere.token\n")
    assert "cluster.yml:5: controller.join.token_file: no such file" in said
