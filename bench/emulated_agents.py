"""The emulated leaves of `emulated_relay`: each leaf's agent answered as
`fdl_fabric.agent.main` answers (SPEC with the pre-flight's values and a real dial,
START, STOP / KILL / SIGNAL, PING, the lease, STACKS, SWEEP, EOF as the leash), with
synthetic ranks instead of processes. A mixin of the emulator's `RelayLoop`; standard
library and fdl_fabric's standalone modules only (``python3 -I -S``).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import sys
import time
from typing import Any, Callable, Dict, Optional

from emulated_ranks import _source_address

from fdl_fabric import rank as rk
from fdl_fabric.agent import checks, wire

#: Pids given to synthetic processes: above any real pid of this machine (pid_max).
FAKE_PID_BASE = 5_000_000
#: Seconds between two checks of the leaves' leases.
LEASE_CHECK = 0.5
SIGNUMS = {name: int(getattr(signal, "SIG" + name)) for name in wire.SIGNALS}


class Skip:
    """Consumes exactly ``n`` bytes (the agent payload), then passes the rest on."""

    def __init__(self, n: int) -> None:
        self.left = n

    def feed(self, data: bytes) -> Optional[bytes]:
        """None while bytes are still to skip; else what followed them."""
        if self.left >= len(data):
            self.left -= len(data)
            return None if self.left or not data else b""
        rest = data[self.left:]
        self.left = 0
        return rest


class SynRank:
    """One synthetic rank: its coordinator connection and its life."""

    def __init__(self, leaf: Leaf, rank: int, pid: int, env: Dict[str, str]) -> None:
        self.leaf = leaf
        self.rank = rank
        self.pid = pid
        self.env = env
        self.running = True
        self.sock: Optional[socket.socket] = None
        self.buf = bytearray()
        self.out = bytearray()
        self.tx = 0
        self.rx = 0
        self.joined = False
        self.connecting = False
        self.attempt = 0
        self.config: Any = None
        self.deadline = 0.0
        self.join_t0: Optional[float] = None
        #: Through its agent: its hello went up and its connection to the agent is open.
        self.relayed = False
        self.joined_at = 0.0
        #: Rejects the coordinator sent whose ``close`` has not come yet.
        self.refused = 0
        self.acked = False
        #: What the loop calls when its socket is ready (set by the emulator).
        self.ready: Optional[Callable[[int, int], None]] = None


class Leaf:
    """One emulated leaf agent (what a leaf's ssh would carry)."""

    def __init__(self, lid: int, payload_bytes: int) -> None:
        self.id = lid
        self.skip: Optional[Skip] = Skip(payload_bytes)
        self.reader = wire.Reader(wire.DOWN_TYPES)
        self.pending_in = b""  # DATA that came before the payload was complete
        self.spec: Optional[Dict[str, Any]] = None
        self.ranks: Dict[int, SynRank] = {}
        self.started = False
        self.stopping = False
        self.input_open = True
        self.finished = False  # DONE sent: the agent (and its ssh) exit
        self.status: Optional[int] = None  # the "ssh"'s exit status, once ended
        self.killed = False  # KILL'ed from the launcher: CLOSED at once, nothing more
        self.lease: Optional[float] = None
        self.last_input = time.monotonic()
        self.last_sent = 0.0
        self.suspended = False
        self.hello_sent = False
        #: Its `wire.BEATS` timer runs (some rank of it is joined through it).
        self.beating = False
        #: The address this leaf's ranks dial from (a host of its own, on loopback).
        self.source: Optional[str] = None


class EmulatedAgents:
    """Every leaf's agent, emulated: what it answers to the launcher's frames."""

    args: Any
    batch: Any
    #: Answers to PROBE, gathered once per kind of request.
    _facts_cache: Dict[str, Any]

    def _agent_hello(self, leaf: Leaf) -> None:
        uname = os.uname()
        self.send(leaf, 0, raw=wire.HANDSHAKE + wire.message(wire.HELLO, {
            "version": wire.VERSION, "pid": self.new_pid(),
            "python": "{}.{}.{}".format(*sys.version_info[:3]),
            "system": uname.sysname, "machine": uname.machine}))
        leaf.hello_sent = True


    def _on_agent_signal(self, leaf: Leaf, body: bytes) -> None:
        obj = wire.parse_json(body)
        name = obj.get("signal")
        if name not in wire.SIGNALS:
            raise wire.ProtocolError(f"cannot forward signal {name!r}")
        self._signal(leaf, SIGNUMS[str(name)], obj.get("rank"))

    def _on_agent_stop(self, leaf: Leaf, body: bytes) -> None:
        obj = wire.parse_json(body) if body else {}
        name = obj.get("signal") or "TERM"
        if name not in ("TERM", "INT"):
            raise wire.ProtocolError(f"cannot stop with signal {name!r}")
        if obj.get("rank") is None:
            self._leash(leaf, SIGNUMS[str(name)])
        else:
            self._signal(leaf, int(signal.SIGTERM), obj.get("rank"))

    def _on_agent_kill(self, leaf: Leaf, body: bytes) -> None:
        leaf.stopping = True
        self._signal(leaf, int(signal.SIGKILL), None)

    def _on_agent_sweep(self, leaf: Leaf, body: bytes) -> None:
        self.send(leaf, wire.SWEPT, _empty_sweep())
        self._finish(leaf)

    def _agent_beat(self, leaf: Leaf) -> None:
        """A PING's answer, as the real agent's: none while its ranks' beats go up, else
        a heartbeat if it sent nothing for a second."""
        if not leaf.beating and time.monotonic() - leaf.last_sent >= wire.HEARTBEAT_INTERVAL:
            self.send(leaf, wire.HEARTBEAT)

    def _on_agent_stacks(self, leaf: Leaf, body: bytes) -> None:
        req = wire.parse_json(body)
        self.send(leaf, wire.STACKS_REPORT, {"id": req.get("id"), "run": req.get("run"),
                                             "ranks": {}, "error": "emulated leaf"})


    def _on_probe(self, leaf: Leaf, request: Dict[str, Any]) -> None:
        """FACTS: no GPU, and the versions the ranks' interpreter sees when asked (a
        launch of a Python command asks; `fdl_fabric.agent.versions`, gathered once per
        kind of request: every emulated leaf is this machine)."""
        facts: Dict[str, Any] = {"gpus": None, "gpu_error": "emulated leaf"}
        if isinstance(request.get("versions"), dict):
            from fdl_fabric.agent import versions

            key = "versions " + json.dumps(request["versions"], sort_keys=True)
            if key not in self._facts_cache:
                self._facts_cache[key] = versions.gather(request["versions"])
            facts["versions"] = self._facts_cache[key]
        self.send(leaf, wire.FACTS, facts)

    def _on_spec(self, leaf: Leaf, spec: Dict[str, Any]) -> None:
        if leaf.spec is not None:
            raise wire.ProtocolError("a second spec")
        if spec.get("version") != wire.VERSION:
            raise wire.ProtocolError(f"spec version {spec.get('version')!r}")
        for key in ("run_id", "cluster", "host", "cwd", "argv", "env", "ranks", "kill_grace"):
            if key not in spec:
                raise wire.ProtocolError(f"spec lacks {key!r}")
        leaf.spec = spec
        leaf.source = _source_address(str(spec["host"]))
        if spec.get("lease"):
            leaf.lease = max(float(spec["lease"]), wire.LEASE_MIN)
        if spec.get("checks"):
            self.send(leaf, wire.PREFLIGHT, {"values": self._preflight(spec)})
        if spec.get("cluster"):
            self.send(leaf, wire.SWEPT, _empty_sweep())
        if spec.get("start_now"):
            self._spawn_all(leaf)

    def _preflight(self, spec: Dict[str, Any]) -> Dict[str, str]:
        """The agent's pre-flight values: the host facts gathered once per kind of spec
        (every emulated leaf is this machine), the coordinator dialled for each leaf."""
        wanted = dict(spec["checks"])
        dial = wanted.pop("dial", None)
        key = json.dumps(wanted, sort_keys=True)
        if key not in self._checks_cache:
            self._checks_cache[key] = checks.gather(wanted, b"\0" * 16, str(spec["run_id"]),
                                                    str(spec["host"]))
        values = dict(self._checks_cache[key])
        if dial:
            envelope = json.loads(bytes.fromhex(str(spec.get("envelope") or "7b7d")))
            salt = bytes.fromhex(str(envelope.get("salt", "00" * 16)))
            values["dial"] = checks.dial(str(dial["host"]), int(dial["port"]), salt,
                                         str(spec["run_id"]), str(spec["host"]))
        return values

    def _spawn_all(self, leaf: Leaf) -> None:
        spec = leaf.spec
        if spec is None:
            raise wire.ProtocolError("start before spec")
        if leaf.started or leaf.stopping:
            return
        leaf.started = True
        base = {str(k): str(v) for k, v in (spec.get("defaults") or {}).items()}
        base.update(spec["env"])
        if spec.get("envelope"):
            base[rk.ENV_CLUSTER_JSON] = str(spec["envelope"])
        now = time.monotonic()
        for entry in spec["ranks"]:
            env = dict(base)
            env.update(entry.get("env") or {})
            r = SynRank(leaf, int(entry["rank"]), self.new_pid(), env)
            leaf.ranks[r.rank] = r
            self.send(leaf, wire.SPAWNED, {"rank": r.rank, "pid": r.pid})
            self.send(leaf, 0, raw=wire.output(r.rank, wire.STDOUT,
                                               f"up {r.rank}\n".encode(), False))
            if self.args.join != "none":
                self._start_join(r)
            self.at(now + self.args.work, functools.partial(self._rank_exit, r, 0, None))

    def _signal(self, leaf: Leaf, sig: int, rank: Optional[Any]) -> None:
        """A signal reaches the ranks' groups: a sleeping synthetic rank dies of it (the
        default action of every signal the launcher forwards)."""
        for r in list(leaf.ranks.values()):
            if r.running and (rank is None or rank == r.rank):
                self._rank_exit(r, None, sig)

    def _leash(self, leaf: Leaf, first: int) -> None:
        if leaf.stopping:
            return
        leaf.stopping = True
        self._signal(leaf, first, None)
        self._maybe_finish(leaf)

    def _leaf_eof(self, leaf: Leaf) -> None:
        """EOF on the leaf agent's stdin: its leash."""
        if not leaf.input_open or leaf.status is not None:
            return
        leaf.input_open = False
        self._leash(leaf, int(signal.SIGTERM))
        self._maybe_finish(leaf)

    def _leaf_killed(self, leaf: Leaf) -> None:
        """KILL: the leaf's ssh is SIGKILLed; its agent stops its ranks unheard."""
        for r in leaf.ranks.values():
            r.running = False
            r.relayed = r.joined = False
            self._close_rank(r)
        leaf.status = -int(signal.SIGKILL)
        self.batch.hurry()

    def _check_leases(self) -> None:
        now = time.monotonic()
        for leaf in list(self.leaves.values()):
            if leaf.lease is None or leaf.stopping or not leaf.input_open or leaf.suspended:
                continue
            if now >= leaf.last_input + leaf.lease:
                self.send(leaf, wire.ERROR, {"message": f"no word from the launcher for "
                                             f"{leaf.lease:g}s: stopping every rank",
                                             "rank": None})
                self._leash(leaf, int(signal.SIGTERM))
        self.at(now + LEASE_CHECK, self._check_leases)

    def _rank_exit(self, r: SynRank, code: Optional[int], sig: Optional[int]) -> None:
        if not r.running:
            return
        r.running = False
        self._relay_exit(r, code)
        if code == 0 and r.joined and r.sock is not None:
            self._rank_send(r, {"type": "exiting"})  # rank.py's atexit hook
        self._close_rank(r)
        leaf = r.leaf
        self.send(leaf, wire.EXITED, {"rank": r.rank, "code": code, "signal": sig})
        self._maybe_finish(leaf)

    def _maybe_finish(self, leaf: Leaf) -> None:
        if leaf.finished or leaf.status is not None:
            return
        if leaf.started:
            if any(r.running for r in leaf.ranks.values()):
                return
            self.send(leaf, wire.VERIFIED, {"stopped": [], "remaining": []})
            self._finish(leaf)
        elif leaf.stopping or not leaf.input_open:
            self._finish(leaf)

    def _finish(self, leaf: Leaf) -> None:
        """DONE, and the agent exits 0: its ssh ends (CLOSED after its last bytes)."""
        if leaf.finished:
            return
        self.send(leaf, wire.DONE)
        leaf.finished = True
        leaf.status = 0
        self.batch.hurry()


def _empty_sweep() -> Dict[str, Any]:
    return {"stopped": [], "leftovers": [], "stale": 0, "errors": [], "live": []}
