#!/usr/bin/env python3
"""An emulated gateway relay for `bench/emulator.py`: the real relay's upward protocol,
with every leaf's agent and ranks emulated in this one process (no ssh, no leaf host).

The launcher starts it instead of the real relay (`emulator.py` swaps the command that
`fdl_fabric.transport.gateway.Relay.start` runs, nothing else), on a real gateway, over a
real SSH session. It reads the agent payload the launcher writes first (its length is on
the command line), then speaks the mux of `fdl_fabric.agent.relay` (docs/protocol.md,
"Relay"): handshake and HELLO, then ``OPEN``/``DATA``/``EOF``/``KILL``/``BLOB``/``PAYLOAD``
down and ``BATCH``/``CLOSED`` up. What goes up is batched by the real relay's own
`relay.Batcher` (every 50 ms, at once after an exit), so the launcher reads exactly the
kind of frames a real relay sends.

Each ``OPEN`` leaf is an emulated agent that never runs ssh: once its payload arrived it
writes the agent handshake and HELLO (`fdl_fabric.agent.wire`), and answers what the
launcher sends it as `fdl_fabric.agent.main` does: SPEC (the pre-flight's values, with
a real ``dial`` of the coordinator; SWEPT), START (SPAWNED for each rank), STOP / KILL /
SIGNAL (the ranks "die" of the signal, as ``sleep`` does), PING (a HEARTBEAT when it sent
nothing else for a second), the lease, SUSPEND/RESUME, STACKS, LIST, SWEEP, and EOF on
its stdin (the leash); after its last rank VERIFIED and DONE, then its "ssh" ends
(CLOSED, status 0).

Each synthetic rank (no process) writes ``up <RANK>`` (one OUTPUT frame), then joins
the launcher's coordinator (its config read by `rank._read_config` from the environment
the spec gives the rank, as the agent would build it). With ``--join agent`` (the
default, as a real launch does since issue 35) through its emulated agent: its hello up
as a COHORT_UP frame, the welcome down as COHORT_DOWN, one BEATS frame a leaf a second
(`emulated_ranks`). With ``--join tcp``, directly: a TCP connection, ``hello`` with the
frames of `fdl_fabric.rank`, ``welcome``, then a ``heartbeat`` every
`rank.HEARTBEAT_INTERVAL`; a ``retry`` reject or a refused connect is dialled again with
rank.py's pauses. ``--join none``: no join. Its "work" ends after ``--work`` seconds
(exit 0, after ``exiting``), or when it is stopped.

Single-threaded, on the real relay's loop (`fdl_fabric.agent.relayloop.RelayLoop`, itself
on the agent's `hostloop`): one selector over stdin, stdout, every rank's socket and a
signal wake-up pipe, plus a timer heap; the mux's HELLO, the launcher's frames by type,
the batching, EOF/EPIPE/TERM and the last flush are the real relay's code, not a copy.
Standard library and fdl_fabric's standalone modules only (the agent's, which a host
has), so it runs under ``python3 -I -S``.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fdl_fabric.agent import mux, relay, wire  # noqa: E402
from fdl_fabric.agent.relayloop import RelayLoop  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I: add bench/ itself
from emulated_agents import (  # noqa: E402
    FAKE_PID_BASE,
    LEASE_CHECK,
    EmulatedAgents,
    Leaf,
    Skip,
)
from emulated_ranks import SyntheticRanks  # noqa: E402

#: Seconds between two notes of the joined count (``--stats``).
JOINED_NOTE = 0.5


class Emulator(EmulatedAgents, SyntheticRanks, RelayLoop):
    """The emulated relay: the real relay's loop, with emulated leaves."""

    INPUT_ERRORS = RelayLoop.INPUT_ERRORS + (wire.ProtocolError,)

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(0, 1)
        self.args = args
        self.skip: Optional[Skip] = Skip(args.payload_bytes)
        self.leaves: Dict[int, Leaf] = {}
        self.timers: List[Tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._pids = FAKE_PID_BASE + (os.getpid() % 1000) * 1000
        self._checks_cache: Dict[str, Dict[str, str]] = {}
        self._facts_cache: Dict[str, Any] = {}
        self.give_up_at: Optional[float] = None
        self.blob: Optional[bytes] = None
        #: For the benchmark (``--stats``): each rank's join time (first dial to welcome),
        #: dials, ``retry`` rejects, welcome bytes, ranks that gave up.
        #: ``last_hello`` and ``formed_at``: wall-clock times of the last hello sent and
        #: of the first ``formed`` broadcast read (the formation time, in emulatorlib);
        #: ``first_hello`` and ``last_welcome`` bound the joins (where a join waits);
        #: ``hello_at`` and ``welcome_at``, by rank, each join's two ends (wall clock), to
        #: be set beside the launcher's ``rank_joined`` record of it (emulatorlib).
        self.stats: Dict[str, Any] = {"join_s": [], "dials": 0, "retry_rejects": 0,
                                      "welcome_bytes": 0, "failed": 0, "lost_before_welcome": 0,
                                      "last_hello": None, "formed_at": None,
                                      "first_hello": None, "last_welcome": None,
                                      "hello_at": {}, "welcome_at": {}}
        self.joined = 0
        self._joined_told = -1
        self.whole({mux.BLOB: self._on_blob, mux.OPEN: self._on_open})
        self.per_leaf({mux.DATA: self._to_leaf, mux.PAYLOAD: self._on_payload,
                       mux.EOF: lambda leaf, rest: self._leaf_eof(leaf),
                       mux.KILL: lambda leaf, rest: self._leaf_killed(leaf)})
        #: What an emulated leaf agent does with each frame from the launcher.
        self.agent_handlers: Dict[int, Callable[[Leaf, bytes], None]] = {
            wire.SPEC: lambda leaf, body: self._on_spec(leaf, wire.parse_json(body)),
            wire.PROBE: lambda leaf, body: self._on_probe(leaf, wire.parse_json(body)),
            wire.START: lambda leaf, body: self._spawn_all(leaf),
            wire.SIGNAL: self._on_agent_signal, wire.STOP: self._on_agent_stop,
            wire.KILL: self._on_agent_kill, wire.SWEEP: self._on_agent_sweep,
            wire.PING: lambda leaf, body: self._agent_beat(leaf),
            wire.SUSPEND: lambda leaf, body: setattr(leaf, "suspended", True),
            wire.RESUME: lambda leaf, body: setattr(leaf, "suspended", False),
            wire.STACKS: self._on_agent_stacks,
            wire.LIST: lambda leaf, body: self.send(leaf, wire.RUNS, {"runs": [], "errors": []}),
            wire.COHORT_DOWN: self._on_cohort_down,
        }

    # -- timers ----------------------------------------------------------------------------
    def at(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (when, self._seq, fn))

    def _run_timers(self, now: float) -> None:
        while self.timers and self.timers[0][0] <= now:
            _, _, fn = heapq.heappop(self.timers)
            fn()

    def new_pid(self) -> int:
        self._pids += 1
        return self._pids

    # -- the relay loop's hooks --------------------------------------------------------------
    def run(self) -> int:
        code = super().run()
        if self.args.stats:
            with contextlib.suppress(OSError), \
                    open(f"{self.args.stats}-{os.getpid()}.json", "w") as f:
                json.dump(self.stats, f)
        return code

    def hello(self) -> None:
        super().hello()
        self.at(time.monotonic() + LEASE_CHECK, self._check_leases)
        if self.args.stats:
            self.at(time.monotonic() + JOINED_NOTE, self._note_joined)

    def _note_joined(self) -> None:
        """``PREFIX-<pid>.joined``: how many synthetic ranks are welcomed, for the
        benchmark to wait on (the launcher holds no socket per rank to count)."""
        if self.joined != self._joined_told:
            self._joined_told = self.joined
            with contextlib.suppress(OSError), \
                    open(f"{self.args.stats}-{os.getpid()}.joined", "w") as f:
                f.write(str(self.joined))
        self.at(time.monotonic() + JOINED_NOTE, self._note_joined)

    def prepare(self) -> None:
        self.want_output()

    def deadlines(self) -> List[float]:
        return [t for t in (self.timers[0][0] if self.timers else None, self.flush_due(),
                            self.give_up_at) if t is not None]

    def after(self, now: float) -> None:
        self._run_timers(now)
        if self.give_up_at is not None and now >= self.give_up_at:
            for leaf in list(self.leaves.values()):
                self._drop(leaf)
        self.flush(now)
        self._close_finished()

    def frames(self, data: bytes) -> List[Tuple[int, bytes]]:
        """The agent payload the launcher writes first is skipped, then the mux."""
        if self.skip is not None:
            rest = self.skip.feed(data)
            if rest is None:
                return []
            self.skip = None
            data = rest
        return self.reader.feed(data)

    def open_leaf(self, lid: int) -> Optional[Leaf]:
        leaf = self.leaves.get(lid)
        return None if leaf is None or leaf.status is not None else leaf

    def let_go(self, now: float) -> None:
        for leaf in list(self.leaves.values()):
            self._leaf_eof(leaf)
        self.give_up_at = now + relay.DRAIN_BOUND

    # -- from the launcher -----------------------------------------------------------------
    def _on_blob(self, body: bytes) -> None:
        self.blob = body

    def _on_open(self, body: bytes) -> None:
        lid, rest = mux.parse_leaf(body)
        if lid in self.leaves:
            raise mux.MuxError(f"leaf {lid} is already open")
        mux.parse_json(rest)["argv"]  # never run: the leaf is emulated
        if not self.upstream:
            return
        self.leaves[lid] = Leaf(lid, self.args.payload_bytes)
        self.batch.open(lid)

    def _on_payload(self, leaf: Leaf, rest: bytes) -> None:
        if self.blob is None:
            raise mux.MuxError("PAYLOAD before any BLOB")
        self._to_leaf(leaf, self.blob)

    # -- to the launcher -------------------------------------------------------------------
    def _close_finished(self) -> None:
        for leaf in [x for x in self.leaves.values()
                     if x.status is not None and not self.batch.backlog(x.id)]:
            self._drop(leaf)

    def _drop(self, leaf: Leaf) -> None:
        self.forget(leaf.id)
        for r in leaf.ranks.values():
            self._close_rank(r)
        self.report_closed(leaf.id,
                           leaf.status if leaf.status is not None else -int(signal.SIGKILL))

    # -- one leaf agent --------------------------------------------------------------------
    def send(self, leaf: Leaf, kind: int, obj: Optional[Dict[str, Any]] = None,
             raw: Optional[bytes] = None) -> None:
        if leaf.status is not None or not self.output_open:
            return
        now = time.monotonic()
        self.batch.add(leaf.id, mux.STDOUT, raw if raw is not None else wire.message(kind, obj),
                       now)
        leaf.last_sent = now

    def _to_leaf(self, leaf: Leaf, data: bytes) -> None:
        if not leaf.input_open:
            return
        leaf.last_input = time.monotonic()
        if leaf.skip is not None:
            rest = leaf.skip.feed(data)
            if rest is None:
                return
            leaf.skip = None
            self._agent_hello(leaf)
            data = rest
        try:
            for kind, body in leaf.reader.feed(data):
                handler = self.agent_handlers.get(kind)
                if handler is not None:
                    handler(leaf, body)
        except wire.ProtocolError as exc:
            self.send(leaf, wire.ERROR, {"message": f"protocol error from the launcher: {exc}",
                                         "rank": None})
            leaf.input_open = False
            self._leash(leaf, signal.SIGTERM)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--payload-bytes", type=int, required=True,
                    help="length of the agent payload the launcher writes first")
    ap.add_argument("--work", type=float, default=40.0,
                    help="seconds each synthetic rank runs before it exits 0 (40)")
    ap.add_argument("--join", choices=("agent", "tcp", "none"), default="agent",
                    help="how synthetic ranks join the coordinator: through their emulated "
                    "agent (agent, the default: a real launch's path), over TCP directly "
                    "(tcp), or not at all (none)")
    ap.add_argument("--stats", metavar="PREFIX",
                    help="write the join figures to PREFIX-<pid>.json at exit")
    args = ap.parse_args(argv)
    return Emulator(args).run()


if __name__ == "__main__":
    sys.exit(main())
