"""``controller.join:``: the join window where workers that dial in (`fdl-fabric join`)
become part of the world (docs/join.md; flodl's ``controller.join``, §2.4).

Read after the workers, because its defaults come from them: a roster's workers whose
agents dial in (``transport: join``) give the window its capacity, the quorum and target
a file leaves out. Every contradiction is refused here, with its line, before anything
listens: ``start: manual`` with a ``target_ranks`` (manual means the operator closes the
window), a target below the quorum, a cap below the window, ``discovery`` without a
quorum, a join kind in the roster without a window.
"""

from __future__ import annotations

import os
from typing import Optional

from ..limits import PORT_MAX, RANKS_MAX, RANKS_PER_WORKER_MAX, SECONDS_MAX
from .model import JOIN_KIND, JoinSpec, StartMode, WorkerSpec
from .problems import Problem
from .yamlread import Field, NodeReader, line_of

JOIN_KEYS = ("min_ranks", "target_ranks", "join_timeout", "max_join_timeout", "discovery",
             "token_file", "start", "port", "bind", "max_ranks_per_host")


def read_join(r: NodeReader, field: Field, workers: list[WorkerSpec], folder: str,
              controller_port: int) -> Optional[JoinSpec]:
    """The window, or None when the file has none (then no worker may dial in)."""
    joining = [w for w in workers if w.transport == JOIN_KIND]
    if field.node is None:
        for w in joining:
            r.add(Problem(r.file, f"workers[{w.index}].transport", w.transport_line or None,
                          "a worker that joins (transport: join) needs a join window: add "
                          "controller.join (docs/join.md)"))
        return None
    block = r.block(field, JOIN_KEYS)
    if block is None:
        return None
    default = JoinSpec(min_ranks=1)
    min_ranks = r.integer(block.field("min_ranks"), minimum=1, maximum=RANKS_MAX)
    target = r.integer(block.field("target_ranks"), minimum=1, maximum=RANKS_MAX)
    window = r.number(block.field("join_timeout"), minimum=0.0, exclusive=True,
                      maximum=SECONDS_MAX)
    cap = r.number(block.field("max_join_timeout"), minimum=0.0, exclusive=True,
                   maximum=SECONDS_MAX)
    discovery = r.boolean(block.field("discovery")) or False
    start_text = r.string(block.field("start"))
    port = r.integer(block.field("port"), minimum=1, maximum=PORT_MAX)
    bind = r.host(block.field("bind"))
    per_host = r.integer(block.field("max_ranks_per_host"), minimum=1,
                         maximum=RANKS_PER_WORKER_MAX)
    token_file = _token_file(r, block.field("token_file"), folder)

    start = StartMode.AUTO
    if start_text is not None:
        try:
            start = StartMode(start_text)
        except ValueError:
            r.problem(block.field("start"), "must be one of auto | manual | hybrid, got "
                      f"{start_text!r}")
    capacity = _capacity(joining)
    if discovery and min_ranks is None:
        r.problem(field, "discovery: true needs min_ranks: with no roster, nothing else says "
                  "how many ranks make a world")
    elif min_ranks is None and capacity is None:
        r.problem(field, "min_ranks is needed: a worker that joins without nproc or "
                  "local_devices says its ranks only when it dials in")
    if not discovery and not joining:
        r.problem(field, "no worker joins: name the ones that dial in with transport: join, "
                  "or set discovery: true to admit any that holds the token")
    if start is StartMode.MANUAL and target is not None:
        r.problem(block.field("target_ranks"), "start: manual waits for `fdl-fabric start`; "
                  "a target that closes the window by itself contradicts it (use start: "
                  "hybrid for both)")
    quorum = min_ranks if min_ranks is not None else (capacity or 1)
    if target is None and not discovery and start is not StartMode.MANUAL:
        target = capacity
    if target is not None and target < quorum:
        r.problem(block.field("target_ranks") if block.has("target_ranks") else field,
                  f"target_ranks ({target}) is below min_ranks ({quorum}): the window would "
                  "close before its quorum")
    window_s = default.join_timeout if window is None else window
    if cap is not None and cap < window_s:
        r.problem(block.field("max_join_timeout"), f"max_join_timeout ({cap:g}s) must be at "
                  f"least join_timeout ({window_s:g}s)")
    cap_s = max(default.max_join_timeout, window_s) if cap is None else cap
    return JoinSpec(min_ranks=quorum, target_ranks=target, join_timeout=window_s,
                    max_join_timeout=cap_s, discovery=discovery, token_file=token_file,
                    start=start, port=port if port is not None else controller_port + 1,
                    bind=bind, max_ranks_per_host=per_host or default.max_ranks_per_host,
                    line=line_of(field.node))


def _capacity(joining: list[WorkerSpec]) -> Optional[int]:
    """The ranks the roster's joiners bring, when the file says each one's count."""
    known = [w.known_ranks for w in joining]
    return None if None in known else sum(n or 0 for n in known)


def _token_file(r: NodeReader, field: Field, folder: str) -> Optional[str]:
    """``token_file``: relative to the cluster file's folder. Its mode is checked when the
    window opens (`joinwire.read_token_file`), since the file may change until then; here
    only that it is there."""
    value = r.path(field)
    if value is None:
        return None
    path = os.path.join(folder, os.path.expanduser(value))
    if not os.path.isfile(path):
        r.problem(field, f"no such file: {path} (a file of yours, mode 0600, holding the "
                  "token as hex)")
        return None
    return path
