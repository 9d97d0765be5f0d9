"""The membership rule between attempts: lost, unreachable, spares, re-admission and
``host_failures`` (`fdl_fabric.supervision.membership`), over a fake probe."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from fdl_fabric.supervision.membership import HostFate, Membership

LOST, FAILED, OK = HostFate.LOST, HostFate.FAILED, HostFate.OK


class Hosts:
    """A fake probe: hosts that are down answer nothing; every probe is recorded."""

    def __init__(self, down: Sequence[str] = ()) -> None:
        self.down = set(down)
        self.probed: list[list[str]] = []

    def __call__(self, names: Sequence[str]) -> Mapping[str, str]:
        self.probed.append(list(names))
        return {n: "connection refused" for n in names if n in self.down}


def test_without_min_hosts_or_spares_every_attempt_is_the_whole_roster_unprobed() -> None:
    m = Membership(["a", "b", "c"])
    hosts = Hosts(down=["b"])
    assert not m.elastic
    assert m.select(0, hosts).hosts == ("a", "b", "c")
    m.after(0, {"b": LOST})
    assert m.select(1, hosts).hosts == ("a", "b", "c")
    assert hosts.probed == []


def test_a_host_cut_off_with_its_gateway_is_probed_for_the_next_attempt_and_not_counted(
        ) -> None:
    m = Membership(["a", "b", "c"], min_hosts=2, host_failures=2)
    hosts = Hosts()
    m.select(0, hosts)
    m.after(0, {"a": LOST, "b": HostFate.CUT_OFF})
    selection = m.select(1, hosts)
    assert hosts.probed[-1] == ["b", "c"], "the lost gateway waits an attempt; its leaf not"
    assert selection.hosts == ("b", "c") and selection.left_out == {"a": "lost in attempt 0"}
    m.after(1, {"b": HostFate.CUT_OFF})
    assert "b" in m.select(2, Hosts(down=["b"])).left_out, "probed, unreachable: left out"
    assert m.select(3, hosts).hosts == ("a", "b", "c"), "never set aside for being cut off"


def test_a_lost_host_is_left_out_of_the_next_attempt_without_a_probe() -> None:
    m = Membership(["a", "b", "c"], min_hosts=2)
    hosts = Hosts()
    m.select(0, hosts)
    m.after(0, {"b": LOST})
    s = m.select(1, hosts)
    assert s.hosts == ("a", "c") and s.enough and not s.full
    assert s.left_out == {"b": "lost in attempt 0"}
    assert hosts.probed[-1] == ["a", "c"]


def test_a_left_out_host_that_answers_is_readmitted_before_the_attempt_after() -> None:
    m = Membership(["a", "b", "c"], min_hosts=2)
    hosts = Hosts()
    m.select(0, hosts)
    m.after(0, {"b": LOST})
    m.select(1, hosts)
    m.after(1, {})
    s = m.select(2, hosts)
    assert s.hosts == ("a", "b", "c") and s.readmitted == ("b",)


def test_a_left_out_host_that_does_not_answer_stays_out_and_is_probed_again_later() -> None:
    m = Membership(["a", "b", "c"], min_hosts=2)
    hosts = Hosts(down=["b"])
    m.select(0, hosts)
    assert m.current == ("a", "c")
    m.after(0, {})
    s = m.select(1, hosts)
    assert s.hosts == ("a", "c") and s.left_out["b"].startswith("unreachable")
    assert "b" in hosts.probed[-1]
    hosts.down.clear()
    m.after(1, {})
    assert m.select(2, hosts).hosts == ("a", "b", "c")


def test_a_spare_takes_a_lost_hosts_place_and_stands_down_when_it_is_readmitted() -> None:
    m = Membership(["a", "b", "c"], spares=["s"], min_hosts=3)
    hosts = Hosts()
    assert m.select(0, hosts).hosts == ("a", "b", "c")
    assert ["s"] not in hosts.probed  # not started unless needed
    m.after(0, {"b": LOST})
    s = m.select(1, hosts)
    assert s.hosts == ("a", "c", "s") and s.spares == ("s",) and s.full
    m.after(1, {})
    s = m.select(2, hosts)
    assert s.hosts == ("a", "b", "c") and s.readmitted == ("b",) and s.spares == ()


def test_spares_are_tried_in_order_until_the_roster_size_is_reached() -> None:
    m = Membership(["a", "b"], spares=["s1", "s2", "s3"], min_hosts=1)
    hosts = Hosts(down=["b", "s1"])
    s = m.select(0, hosts)
    assert s.hosts == ("a", "s2")
    assert hosts.probed == [["a", "b"], ["s1"], ["s2"]]
    assert s.left_out == {"b": "unreachable (connection refused)",
                          "s1": "unreachable (connection refused)"}


def test_too_few_hosts_is_not_enough_and_names_why_each_is_out() -> None:
    m = Membership(["node1", "node2", "node3"], min_hosts=2)
    hosts = Hosts()
    m.select(0, hosts)
    m.after(0, {"node1": LOST})
    hosts.down.add("node2")
    s = m.select(1, hosts)
    assert not s.enough and s.hosts == ("node3",)
    assert s.left_out == {"node1": "lost in attempt 0",
                          "node2": "unreachable (connection refused)"}


def test_a_host_that_fails_host_failures_attempts_in_a_row_is_set_aside() -> None:
    m = Membership(["a", "b", "c"], min_hosts=1, host_failures=2)
    hosts = Hosts()
    m.select(0, hosts)
    m.after(0, {"b": FAILED})
    assert m.select(1, hosts).hosts == ("a", "b", "c")  # a failed rank: the host stays
    m.after(1, {"b": FAILED})
    s = m.select(2, hosts)
    assert s.hosts == ("a", "c")
    assert s.left_out == {"b": "set aside after 2 failed attempts in a row"}
    m.after(2, {})
    assert m.select(3, hosts).hosts == ("a", "c")  # for the rest of the launch


def test_a_good_attempt_resets_the_count_of_failures_in_a_row() -> None:
    m = Membership(["a", "b"], min_hosts=1, host_failures=2)
    hosts = Hosts()
    m.select(0, hosts)
    m.after(0, {"b": FAILED})
    m.select(1, hosts)
    m.after(1, {"b": OK})
    m.select(2, hosts)
    m.after(2, {"b": FAILED})
    assert m.select(3, hosts).hosts == ("a", "b")


def test_a_host_lost_twice_in_a_row_with_host_failures_2_is_not_probed_again() -> None:
    m = Membership(["a", "b"], min_hosts=1, host_failures=2)
    hosts = Hosts()
    m.select(0, hosts)
    m.after(0, {"b": LOST})
    m.select(1, hosts)
    m.after(1, {})
    assert m.select(2, hosts).readmitted == ("b",)
    m.after(2, {"b": LOST})
    m.select(3, hosts)
    m.after(3, {})
    s = m.select(4, hosts)
    assert s.hosts == ("a",) and "set aside" in s.left_out["b"]
    assert all("b" not in p for p in hosts.probed[-2:])


def test_a_host_in_good_standing_whose_reconnect_fails_is_left_out_as_unreachable() -> None:
    m = Membership(["a", "b", "c"], min_hosts=2)
    hosts = Hosts()
    m.select(0, hosts)
    m.after(0, {})
    hosts.down.add("c")
    s = m.select(1, hosts)
    assert s.hosts == ("a", "b") and s.left_out == {"c": "unreachable (connection refused)"}


@pytest.mark.parametrize("kwargs", [{"min_hosts": 0}, {"min_hosts": 4}, {"host_failures": 0}])
def test_bad_settings_are_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        Membership(["a", "b", "c"], **kwargs)
