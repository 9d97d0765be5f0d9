"""The join window's rules, as data: who is admitted, and when the world forms.

Pure (no sockets, no clock of its own), so the rules are tested on their own; the
window that listens and the launch that waits on it are `transport.joinport` and
`commands.joinwindow`.

**Admission** (flodl's `MembershipLedger`, §5.7): a joiner is refused, that attempt
only, with the reason it is told: no host name, a host already in, a host not in the
roster (unless ``discovery``), a run id it was not started for, more ranks than
``max_ranks_per_host``, none at all, or a count the roster contradicts.

**The verdict**, flodl's order, asked at every turn of the window (`JoinLedger.decide`):
1. the operator started it, the mode is not ``auto``, and the quorum is in: formed;
2. a target is set, the mode is not ``manual``, and the target is in: formed;
3. the window is still open: wait (a quorum reached early does not close it);
4. the mode is not ``manual`` and the quorum is in: formed;
5. the hard cap is not reached: wait;
6. otherwise: failed ("quorum not met", or under ``manual`` "operator start not
   received").

**Rank numbering** is deterministic: the roster's hosts in the file's order, then the
walk-ins of a discovery window in the order of their host names; within a host, its
devices in order (`ordered_hosts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from ..clusterfile import JoinSpec, StartMode
from ..clusterfile.names import host_name_problem


class WindowState(str, Enum):
    """Where a window stands."""

    OPEN = "open"
    FORMED = "formed"
    FAILED = "failed"


class Why(str, Enum):
    """Why a window formed or failed: data, the words are the renderer's."""

    OPERATOR_START = "operator start"
    TARGET_REACHED = "target ranks reached"
    WINDOW_CLOSED = "join window closed with quorum"
    QUORUM_NOT_MET = "quorum not met"
    START_NOT_RECEIVED = "operator start not received"


@dataclass(frozen=True)
class Decision:
    state: WindowState
    why: Optional[Why] = None


@dataclass(frozen=True)
class Offer:
    """What a joiner's hello offers: its host name, its ranks (a count, or its devices),
    the run it was started for (None: any), where its ranks run, and its versions."""

    host: str
    nproc: Optional[int] = None
    devices: Optional[tuple[int, ...]] = None
    run_id: Optional[str] = None
    path: str = ""
    version: str = ""
    python: str = ""

    @property
    def ranks(self) -> int:
        if self.devices is not None:
            return len(self.devices)
        return self.nproc or 0


@dataclass(frozen=True)
class Refusal:
    """Why a joiner is turned away; ``permanent``: dialling again with the same flags will
    not help (its `--persist` loop stops)."""

    reason: str
    permanent: bool = False


@dataclass
class JoinLedger:
    """The window's members and its rules (see the module docstring)."""

    spec: JoinSpec
    run_id: str
    #: The roster's hosts that dial in, each with the ranks the file gives it.
    roster: Mapping[str, int] = field(default_factory=dict)
    #: Admitted joiners by host, in admission order.
    joined: dict[str, Offer] = field(default_factory=dict)
    #: The operator's start (`fdl-fabric start`).
    armed: bool = False
    #: Once formed or failed, nobody else is admitted.
    closed: Optional[Decision] = None

    @property
    def ranks_in(self) -> int:
        return sum(self.ranks_of(o) for o in self.joined.values())

    def ranks_of(self, offer: Offer) -> int:
        """A joiner's ranks: the roster's count for a roster host, else its offer's."""
        return self.roster.get(offer.host, offer.ranks)

    def refusal(self, offer: Offer) -> Optional[Refusal]:
        """Why ``offer`` cannot join, or None."""
        if self.closed is not None and self.closed.state is WindowState.FORMED:
            return Refusal("the world has formed; it takes no new host until this run "
                           "ends: the next window is the next run's (--persist dials again)")
        if self.closed is not None:
            return Refusal(f"the window has closed ({self.closed.state.value}"
                           + (f": {self.closed.why.value}" if self.closed.why else "") + ")")
        if not offer.host:
            return Refusal("no host name (fdl-fabric join --host NAME)", permanent=True)
        if (problem := host_name_problem(offer.host)) is not None:
            return Refusal(f"its host name is not one: {problem}", permanent=True)
        if offer.host in self.joined:
            return Refusal(f"host {offer.host!r} already joined this run (a duplicate "
                           "join: give each worker its own --host)", permanent=True)
        if offer.run_id is not None and offer.run_id != self.run_id:
            return Refusal(f"it was started for run {offer.run_id!r}, this is "
                           f"{self.run_id!r}", permanent=True)
        if offer.host not in self.roster and not self.spec.discovery:
            return Refusal(f"host {offer.host!r} is not in the cluster file's workers, and "
                           "the window admits no walk-ins (discovery: false)", permanent=True)
        if offer.devices is not None and len(set(offer.devices)) != len(offer.devices):
            return Refusal("a device is offered twice", permanent=True)
        limit = self.spec.max_ranks_per_host
        if offer.ranks > limit:
            return Refusal(f"it offers {offer.ranks} ranks, more than the window's "
                           f"max_ranks_per_host ({limit})", permanent=True)
        expected = self.roster.get(offer.host)
        if expected is None and offer.ranks == 0:
            return Refusal("it offers no ranks (--nproc N or --devices LIST)", permanent=True)
        if expected is not None and offer.ranks and offer.ranks != expected:
            return Refusal(f"the cluster file gives {offer.host!r} {expected} rank(s), it "
                           f"offers {offer.ranks}", permanent=True)
        return None

    def admit(self, offer: Offer) -> Optional[Refusal]:
        """Admit ``offer`` unless refused; the refusal, or None once it is in."""
        refused = self.refusal(offer)
        if refused is None:
            self.joined[offer.host] = offer
        return refused

    def retract(self, host: str) -> None:
        """A joiner that left before the world formed (its connection closed)."""
        if self.closed is None:
            self.joined.pop(host, None)

    def arm(self) -> Optional[str]:
        """The operator's start; why it is refused, or None once armed."""
        if self.spec.start is StartMode.AUTO:
            return "the window's start is auto: it closes by itself"
        if self.closed is not None:
            return f"the window has already closed ({self.closed.state.value})"
        if self.ranks_in < self.spec.min_ranks:
            return f"quorum not met ({self.ranks_in}/{self.spec.min_ranks} ranks)"
        self.armed = True
        return None

    def decide(self, elapsed: float) -> Decision:
        """The window's state after ``elapsed`` seconds (flodl's order); a closing decision
        is kept, and closes admission."""
        if self.closed is not None:
            return self.closed
        decision = self._decide(elapsed)
        if decision.state is not WindowState.OPEN:
            self.closed = decision
        return decision

    def _decide(self, elapsed: float) -> Decision:
        spec, joined = self.spec, self.ranks_in
        quorum = joined >= spec.min_ranks
        if self.armed and spec.start is not StartMode.AUTO and quorum:
            return Decision(WindowState.FORMED, Why.OPERATOR_START)
        if spec.target_ranks is not None and spec.start is not StartMode.MANUAL \
                and joined >= spec.target_ranks:
            return Decision(WindowState.FORMED, Why.TARGET_REACHED)
        if elapsed < spec.join_timeout:
            return Decision(WindowState.OPEN)
        if spec.start is not StartMode.MANUAL and quorum:
            return Decision(WindowState.FORMED, Why.WINDOW_CLOSED)
        if elapsed < spec.max_join_timeout:
            return Decision(WindowState.OPEN)
        if spec.start is StartMode.MANUAL and quorum:
            return Decision(WindowState.FAILED, Why.START_NOT_RECEIVED)
        return Decision(WindowState.FAILED, Why.QUORUM_NOT_MET)

    def ordered_hosts(self, roster_order: Sequence[str]) -> list[str]:
        """The joined hosts in rank order: the roster's first, in the file's order, then
        the walk-ins by host name."""
        in_roster = [h for h in roster_order if h in self.joined]
        walk_ins = sorted(h for h in self.joined if h not in self.roster)
        return in_roster + walk_ins
