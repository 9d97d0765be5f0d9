"""Where the ranks are: every rank's stack, grouped by where its main thread stands.

A hung collective looks like this from the outside: one rank somewhere else (a slow
step, a deadlock, a ``sleep``), and every other rank waiting in the same call. So the
view groups ranks by the innermost frame of their main thread and prints the small
groups first: the odd ones out are the suspects::

    rank 1 (node1): stuck_here (hang.py:3)
    ranks 0, 2, 3 (node0, node1): all_reduce (distributed_c10d.py:2801)

The data comes from each host's agent (`fdl_fabric.agent.stacks`): py-spy's threads
when the host has py-spy, and always what /proc says (state, wchan, system call, CPU
time), which is what a rank without a Python stack is grouped by. Pure functions: the
console renders `stacks_text`, the run log keeps `dump_text` per rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def main_thread(entry: Mapping[str, Any]) -> Mapping[str, Any] | None:
    threads = entry.get("threads") or []
    for thread in threads:
        if thread.get("name") == "MainThread":
            return thread  # type: ignore[no-any-return]
    return threads[0] if threads else None  # type: ignore[no-any-return]


def frame_text(frame: Mapping[str, Any], *, short: bool = False) -> str:
    """``name (file:line)``; ``short`` keeps only the file's base name (the grouped view)."""
    file = str(frame.get("file", "?"))
    if short:
        file = file.rsplit("/", 1)[-1]
    return f"{frame.get('name', '?')} ({file}:{frame.get('line', 0)})"


def where(entry: Mapping[str, Any]) -> str:
    """One rank's place: its main thread's innermost Python frame, or what /proc says."""
    thread = main_thread(entry)
    if thread is not None and thread.get("frames"):
        return frame_text(thread["frames"][0], short=True)
    proc = entry.get("proc") or {}
    parts = [f"state {proc.get('state', '?')}"]
    for key in ("wchan", "syscall"):
        if proc.get(key):
            parts.append(f"{key} {proc[key]}")
    return "no Python stack: " + ", ".join(parts)


def rank_list(ranks: Sequence[int]) -> str:
    """``0, 2-5, 7``: ranks in order, runs folded."""
    out: list[str] = []
    items = sorted(ranks)
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if j - i < 2 else f"{items[i]}-{items[j]}")
        if j - i == 1:
            out.append(str(items[j]))
        i = j + 1
    return ", ".join(out)


def groups(ranks: Mapping[str, Mapping[str, Any]],
           hosts: Mapping[str, str]) -> list[tuple[str, list[int], list[str]]]:
    """``(where, ranks, hosts)`` per distinct place, the smallest groups first."""
    by_place: dict[str, list[int]] = {}
    for rank, entry in ranks.items():
        by_place.setdefault(where(entry), []).append(int(rank))
    found = []
    for place, members in by_place.items():
        members.sort()
        names = list(dict.fromkeys(hosts.get(str(r), "?") for r in members))
        found.append((place, members, names))
    found.sort(key=lambda g: (len(g[1]), g[1][0]))
    return found


def stacks_text(data: Mapping[str, Any]) -> str:
    """The grouped view of a ``stacks`` event, one line per group, then what is missing."""
    ranks: Mapping[str, Mapping[str, Any]] = data.get("ranks") or {}
    hosts: Mapping[str, str] = data.get("hosts") or {}
    lines = [f"cluster launcher: where each rank is ({data.get('reason', 'asked')}):"]
    for place, members, names in groups(ranks, hosts):
        who = f"rank {members[0]}" if len(members) == 1 else f"ranks {rank_list(members)}"
        lines.append(f"  {who} ({', '.join(names)}): {place}")
    for host, problem in sorted((data.get("problems") or {}).items()):
        lines.append(f"  {host}: no stacks: {problem}")
    without = sorted(h for h, found in (data.get("py_spy") or {}).items() if not found)
    if without:
        lines.append(f"  (no py-spy on {', '.join(without)}: `pip install fdl-fabric[stacks]` "
                     "there for Python stacks)")
    if not ranks and not data.get("problems"):
        lines.append("  no running rank")
    return "\n".join(lines)


def dump_text(rank: str, host: str, entry: Mapping[str, Any]) -> str:
    """One rank's whole report, as kept under ``--log-dir`` (``stacks/r<N>.txt``)."""
    proc = entry.get("proc") or {}
    head = [f"rank {rank} on {host} (pid {entry.get('pid')}"
            + (f", dumped pid {entry['target']}" if entry.get("target") not in (None,
                                                                               entry.get("pid"))
               else "") + ")"]
    facts = [f"state {proc.get('state', '?')}"]
    for key in ("wchan", "syscall"):
        if proc.get(key):
            facts.append(f"{key} {proc[key]}")
    if "cpu" in proc:
        facts.append(f"{proc['cpu']}s CPU in the last {proc.get('window', '?')}s")
    head.append(", ".join(facts))
    if proc.get("cmdline"):
        head.append(f"command: {proc['cmdline']}")
    if entry.get("error"):
        head.append(f"no Python stack: {entry['error']}")
    body = []
    for thread in entry.get("threads") or []:
        state = "active" if thread.get("active") else "idle"
        body.append(f'Thread {thread.get("id")} ({state}): "{thread.get("name")}"')
        body += [f"    {frame_text(f)}" for f in thread.get("frames") or []]
    return "\n".join(head + [""] + body) + "\n"
