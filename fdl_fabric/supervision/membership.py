"""Which hosts each attempt runs on: lost hosts left out, spares, re-admission.

torchrun's ``--nnodes MIN:MAX`` and Horovod elastic carry on with the hosts that answer.
Here the unit is the attempt: a plain DDP or Lightning script cannot shrink its process
group, but it can resume from a checkpoint on fewer hosts. Between attempts:

* a host that was lost, unresponsive or unreachable is left out of the next attempt;
* a host left out earlier is probed again (one connect) before each later attempt, and
  re-admitted if it answers;
* spares (``spare: true``) fill the attempt up to the roster's size, after the roster's
  own hosts (re-admitted hosts go before spares);
* a host whose ranks failed, or that was lost, in ``host_failures`` attempts in a row is
  set aside for the rest of the launch (Horovod's blacklist);
* a host cut off with its gateway (issue 23's tree) is not counted against it: it is
  probed again, through the gateways that are left, before the very next attempt;
* an attempt starts only with at least ``min_hosts`` hosts.

Without ``min_hosts`` and without spares nothing is elastic: every attempt runs on the
whole roster, and a host that cannot be reached ends the launch, as before
(`Membership.elastic` is False and the launcher keeps its old path).

This module only decides; the launcher connects (the ``probe`` it is given) and starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional


class HostFate(str, Enum):
    """How a host came out of an attempt."""

    #: Its ranks ended well, or were stopped because of another host.
    OK = "ok"
    #: One of its ranks failed (the host itself answered).
    FAILED = "failed"
    #: Its agent's stream was lost, or it stopped answering (`agent_timeout`).
    LOST = "lost"
    #: It could not be connected before the attempt.
    UNREACHABLE = "unreachable"
    #: It was reached through a gateway that was lost: nothing is known of the host
    #: itself, so it is not counted against it and is probed for the very next attempt.
    CUT_OFF = "cut_off"


#: Connect these hosts (in parallel, each bounded by its connect timeout); returns the
#: ones that failed, with why.
Probe = Callable[[Sequence[str]], Mapping[str, str]]


@dataclass
class _Host:
    name: str
    spare: bool
    #: Attempts in a row in which its ranks failed or it was lost.
    failures: int = 0
    #: Why it is out of the current selection ("lost in attempt 0", "unreachable").
    out: Optional[str] = None
    #: The attempt before which it may be probed again.
    probe_from: int = 0
    set_aside: bool = False


@dataclass(frozen=True)
class Selection:
    """The hosts of one attempt, in roster order, and why the others are not in it."""

    attempt: int
    hosts: tuple[str, ...]
    #: Hosts of the roster or spares not in this attempt, and why (only the roster's and
    #: the spares that were tried).
    left_out: Mapping[str, str]
    #: The roster's size: what a full attempt has.
    target: int
    min_hosts: int
    readmitted: tuple[str, ...] = ()
    spares: tuple[str, ...] = ()

    @property
    def enough(self) -> bool:
        return len(self.hosts) >= self.min_hosts

    @property
    def full(self) -> bool:
        return len(self.hosts) >= self.target


@dataclass
class Membership:
    """The membership rule over a launch's attempts; see the module docstring."""

    roster: Sequence[str]
    spares: Sequence[str] = ()
    min_hosts: Optional[int] = None
    host_failures: int = 3
    _hosts: dict[str, _Host] = field(default_factory=dict, init=False)
    _current: tuple[str, ...] = field(default=(), init=False)
    #: The last selection made.
    last: Optional[Selection] = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.roster:
            raise ValueError("membership: the roster is empty")
        if self.min_hosts is not None and not 1 <= self.min_hosts <= len(self.roster):
            raise ValueError(f"membership: min_hosts must be 1-{len(self.roster)}, "
                             f"got {self.min_hosts}")
        if self.host_failures < 1:
            raise ValueError("membership: host_failures must be >= 1")
        for name in self.roster:
            self._hosts[name] = _Host(name, spare=False)
        for name in self.spares:
            self._hosts[name] = _Host(name, spare=True)

    @property
    def elastic(self) -> bool:
        """Whether attempts may differ from the roster at all."""
        return self.min_hosts is not None or bool(self.spares)

    @property
    def target(self) -> int:
        return len(self.roster)

    @property
    def needed(self) -> int:
        return self.target if self.min_hosts is None else self.min_hosts

    @property
    def current(self) -> tuple[str, ...]:
        return self._current

    def select(self, attempt: int, probe: Probe) -> Selection:
        """The hosts of ``attempt``: the roster's hosts that are in good standing or may be
        re-admitted, then spares, up to the roster's size; each one probed (``probe``
        connects what is not connected and answers at once for the rest). Spares are
        probed only as many as are missing, round by round; a round is bounded by the
        connect timeout, and there are at most as many rounds as spares."""
        if not self.elastic:
            self._current = tuple(self.roster)
            return self._selection(attempt, list(self.roster), {}, (), ())
        before = set(self._current)
        wanted = [h for h in [*self.roster, *self.spares] if self._wanted(h, attempt)]
        chosen = self._probe(wanted, probe, attempt)
        tried = set(wanted)
        chosen += self._spares_for(self.target - len(chosen), attempt, probe, tried)
        chosen = self._stand_down_spares(chosen)
        self._current = tuple(chosen)
        readmitted = tuple(h for h in chosen if attempt > 0 and h not in before
                           and not self._hosts[h].spare)
        return self._selection(attempt, chosen, self._left_out(chosen), readmitted,
                               tuple(h for h in chosen if self._hosts[h].spare))

    def _left_out(self, chosen: Sequence[str]) -> dict[str, str]:
        """The roster's hosts not chosen, and spares that were tried or set aside: why."""
        return {h.name: self._why(h) for h in self._hosts.values()
                if h.name not in chosen and (not h.spare or h.out or h.set_aside)}

    def _wanted(self, name: str, attempt: int) -> bool:
        """Probed first: hosts in good standing (spares too), and the roster's hosts that
        may be re-admitted."""
        return self._in(name) or (not self._hosts[name].spare and self._may_probe(name, attempt))

    def _spares_for(self, missing: int, attempt: int, probe: Probe, tried: set[str]
                    ) -> list[str]:
        """Up to ``missing`` spares that answer, tried in order, a round at a time."""
        found: list[str] = []
        candidates = [h for h in self.spares if h not in tried and self._may_probe(h, attempt)]
        while len(found) < missing and candidates:
            round_ = candidates[:missing - len(found)]
            candidates = candidates[len(round_):]
            tried.update(round_)
            found += self._probe(round_, probe, attempt)
        return found

    def _stand_down_spares(self, chosen: list[str]) -> list[str]:
        """Re-admitted hosts go before spares: spares beyond the roster's size stand down
        (the last ones first); the rest in roster order, spares after."""
        chosen = list(chosen)
        while len(chosen) > self.target:
            chosen.remove(next(h for h in reversed(chosen) if self._hosts[h].spare))
        order = {h: i for i, h in enumerate([*self.roster, *self.spares])}
        return sorted(chosen, key=order.__getitem__)

    def after(self, attempt: int, fates: Mapping[str, HostFate]) -> None:
        """Record how each host of ``attempt`` came out of it."""
        for name in self._current:
            host = self._hosts[name]
            fate = fates.get(name, HostFate.OK)
            if fate is HostFate.OK:
                host.failures = 0
                continue
            if fate is HostFate.CUT_OFF:
                host.out = f"cut off with its gateway in attempt {attempt}"
                host.probe_from = attempt + 1  # probed again before the next attempt
                continue
            host.failures += 1
            if fate is HostFate.LOST:
                host.out = f"lost in attempt {attempt}"
                host.probe_from = attempt + 2  # left out of the next attempt
            if host.failures >= self.host_failures:
                host.set_aside = True

    # -- the rule's parts ------------------------------------------------------------------
    def _in(self, name: str) -> bool:
        """Connected and in good standing: it ran the last attempt and was not lost."""
        host = self._hosts[name]
        return name in self._current and host.out is None and not host.set_aside

    def _may_probe(self, name: str, attempt: int) -> bool:
        host = self._hosts[name]
        return (name not in self._current or host.out is not None) \
            and not host.set_aside and attempt >= host.probe_from

    def _probe(self, names: Sequence[str], probe: Probe, attempt: int) -> list[str]:
        """Probe ``names``; the ones that answered, in order. One that did not is out
        until the next attempt."""
        if not names:
            return []
        failed = probe(list(names))
        answered = []
        for name in names:
            host = self._hosts[name]
            if name in failed:
                host.out = f"unreachable ({failed[name]})" if failed[name] else "unreachable"
                host.probe_from = attempt + 1
            else:
                host.out = None
                answered.append(name)
        return answered

    def _why(self, host: _Host) -> str:
        if host.set_aside:
            return f"set aside after {host.failures} failed attempts in a row"
        return host.out or "not needed"

    def _selection(self, attempt: int, chosen: Sequence[str], left_out: Mapping[str, str],
                   readmitted: tuple[str, ...], spares: tuple[str, ...]) -> Selection:
        self.last = Selection(attempt=attempt, hosts=tuple(chosen), left_out=dict(left_out),
                         target=self.target, min_hosts=self.needed, readmitted=readmitted,
                         spares=spares)
        return self.last
