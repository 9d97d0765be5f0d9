"""The worker agent: one process per host that starts, leashes and reports that host's ranks.

This package is what runs *on* each worker host (flodl 0.7.0's agent phase). The
launcher ships its source over the agent's stdin, so nothing is installed on hosts,
and that decides its rules:

* standard library only, Python 3.8 or newer (whatever ``python3`` the host has);
* no imports from the rest of fdl_fabric, except `fdl_fabric.rank` (itself
  standalone), which the launcher ships alongside;
* one concern per module, so each is testable on its own without SSH:

  - `wire`: the framed protocol on the agent's stdin/stdout (docs/protocol.md);
  - `lines`: rank output turned into whole-line chunks, in linear time;
  - `pids`: which processes are there and which belong to a run, stopping them;
  - `procs`: the run registry and a cleanup's sweep (and `pids`' names, re-exported);
  - `children`: starting one rank (fork, setsid, exec) with its pipes;
  - `ranks`: the agent's ranks: started, their output as frames, their exits;
  - `collectors`: the agent's stack requests;
  - `checks`: the fast pre-flight facts of this host;
  - `watchdog`: the process that stops the ranks if the agent itself is killed;
  - `cohortrelay`: the ranks' Unix socket: the agent speaks to the coordinator for its
    ranks, one stream and one folded heartbeat per host (issue 35);
  - `hostloop`: the one event loop (select, frames, leash, signals) of the agent and
    the relay;
  - `main`: the agent on that loop, tying the others together;
  - `mux`, `relayloop`, `relay`: a gateway's relay: its framing, its loop and batching
    (shared with the bench's emulated relay), its leaves.

The launcher side of the protocol lives in `fdl_fabric.transport.session`;
`fdl_fabric.transport.bundle` builds what is sent to start an agent (every module here).
"""
