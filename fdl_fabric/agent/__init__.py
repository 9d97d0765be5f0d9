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
  - `procs`: which processes belong to a run, the run registry, stopping them;
  - `children`: starting one rank (fork, setsid, exec) with its pipes;
  - `checks`: the fast pre-flight facts of this host;
  - `watchdog`: the process that stops the ranks if the agent itself is killed;
  - `main`: the agent's event loop, tying the others together.

The launcher side of the protocol lives in `fdl_fabric.sessions`; `fdl_fabric.bundle`
builds what is sent to start an agent.
"""
