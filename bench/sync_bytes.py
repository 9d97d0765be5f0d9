"""sync.py's fourth section: the bytes the launcher uploads at 32 hosts, flat and through
the gateway tree, for a first sync, a no-change sync and no sync, and the control frames
a sync adds beside the files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import benchlib
from benchlib import fmt, med
from synclib import Bench, Launch, Project, mib, sent_by

# -- bytes at 32 hosts --------------------------------------------------------------------------
#: The launches of one layout in the bytes section: a first sync (every store emptied
#: before), the same again (nothing changed: every host has the tree), no sync.
BYTES_VARIANTS = ("first", "again", "no-sync")


def bytes_section(b: Bench) -> dict[str, Any]:
    hosts = b.lab.hosts[:b.args.bytes_hosts]
    ports = {h.port for h in hosts}
    small = b.small_project
    cases = [("flat", b.args.bytes_hosts * 2), ("tree", b.args.tree_fanout)]
    clusters = {name: b.cluster(hosts, small.root, f"bytes-{name}", fanout=fanout)
                for name, fanout in cases}

    def reading(name: str, pid: int) -> tuple[int, int]:
        return sent_by(pid, ports)

    results: dict[str, list[dict[str, Launch]]] = {name: [] for name, _ in cases}
    for rep in range(b.args.bytes_repeat):
        b.say(f"bytes round {rep + 1}/{b.args.bytes_repeat} ({len(hosts)} hosts):")
        for name, _fanout in (cases if rep % 2 == 0 else cases[::-1]):
            runs = {}
            for variant in BYTES_VARIANTS:
                if variant == "first":
                    b.clear_stores(hosts)
                os.sync()
                extra = ("--cmd", "sleep 3") + (("--no-sync",) if variant == "no-sync" else ())
                r = b.launch(clusters[name], *extra, on_record=reading, watch=("launch",))
                runs[variant] = r
                seen = r.seen.get("launch")
                b.say(f" {name}/{variant} {mib(seen[0]) if seen else 'x'}"
                      f"{'' if r.ok else ' (' + r.error[:120] + ')'}")
            results[name].append(runs)
        b.say(f"  (load {benchlib.loadavg()})\n")
    ask, whole, serve = _control_frames(small.root, hosts[0].path)
    return {"results": results, "hosts": len(hosts), "fanouts": dict(cases),
            "project": small, "ask": ask, "manifest": whole, "serve": serve}


def _control_frames(src: Path, host_path: str) -> tuple[int, int, int]:
    """Bytes, before SSH framing, of the frames a sync adds beside the files: the SYNC
    that asks each host for the tree, the SYNC_MANIFEST (one frame, to each host that
    lacks the tree: through the tree, once to each gateway's agent and once to its relay,
    which keeps it and replays it to its leaves), and the SERVE the launcher writes to a
    gateway's relay for each leaf (the indices of the entries it lacks)."""
    import json

    from fdl_fabric.agent import relay, wire
    from fdl_fabric.agent.codestore import STORE
    from fdl_fabric.clusterfile.model import SyncSpec
    from fdl_fabric.sync import manifest

    m = manifest.build(SyncSpec(src=str(src)), cache_dir=src.parent / "hash-cache-probe")
    ask = wire.message(wire.SYNC, {"tree": m.tree, "path": host_path})
    whole = wire.frame(wire.SYNC_MANIFEST, json.dumps(
        {"entries": m.wire()}, separators=(",", ":")).encode())
    need = [i for i, e in enumerate(m.entries) if e.kind == "f"]
    serve = relay.leaf_frame(relay.SERVE, 1, relay.json_body(
        {"root": str(Path(host_path) / STORE), "need": need}))
    return len(ask), len(whole), len(serve)


def report_bytes(res: dict[str, Any], b: Bench, targets: list[list[str]]) -> None:
    proj: Project = res["project"]
    n = res["hosts"]
    b.say(f"\n4. bytes the launcher uploads, {n} hosts, a project of {proj.files} files, "
          f"{mib(proj.bytes)} ({len(next(iter(res['results'].values())))} round(s), "
          "medians)\n\n")
    rows = [["layout", "fanout", "launcher's connections", "sent, no sync", "first sync adds",
             "/ project", "files' copies", "no-change sync adds", "first sync step s",
             "no-change step s"]]
    for name, runs in res["results"].items():
        ok = [r for r in runs if all(r[v].ok and "launch" in r[v].seen for v in BYTES_VARIANTS)]
        for r in runs:
            for v in BYTES_VARIANTS:
                if not r[v].ok:
                    b.say(f"  ! {name} {v}: {r[v].error[:300]}\n")
        if not ok:
            rows.append([name, str(res["fanouts"][name])] + ["x"] * 8)
            continue

        def sent(variant: str, ok: list[dict[str, Launch]] = ok) -> float:
            got = med([float(r[variant].seen["launch"][0]) for r in ok])
            assert got is not None
            return got

        conns = int(med([float(r["first"].seen["launch"][1]) for r in ok]) or 0)
        base = sent("no-sync")
        added, again = sent("first") - base, sent("again") - base
        if name == "tree":  # the manifest to each gateway's agent and relay; SERVE per leaf
            control = n * res["ask"] + 2 * conns * res["manifest"] + (n - conns) * res["serve"]
        else:
            control = n * (res["ask"] + res["manifest"])
        data_copies = (added - control) / proj.bytes
        rows.append([name, str(res["fanouts"][name]), str(conns), mib(base), mib(added),
                     f"{added / proj.bytes:.2f}", f"{data_copies:.2f}", mib(again),
                     fmt(med([r["first"].in_place for r in ok])),
                     fmt(med([r["again"].in_place for r in ok]))])
        if name == "tree":
            # each of the `conns` gateways gets one copy; the control frames ride on top
            met = conns - 0.5 <= data_copies < conns + 0.5
            targets.append([f"bytes uploaded at {n} hosts through the tree (fanout "
                            f"{res['fanouts'][name]}): copies of the files",
                            f"{data_copies:.2f}", f"one per gateway ({conns})",
                            "met" if met else "MISSED"])
            targets.append([f"  the same, all it added ({mib(added)}) / project",
                            f"{added / proj.bytes:.2f}", "", "(control frames: see text)"])
    b.say(benchlib.table(rows, [False] + [True] * 9) + "\n")
    b.say(f"launcher's connections: its TCP connections to lab sshd's (the hosts it reaches "
          f"itself: the gateways in the tree). Sent: bytes_sent on those connections when "
          f"its `launch` record is read. Control frames the launcher writes: a SYNC asking "
          f"each host for the tree ({res['ask']} B; all a no-change sync sends), the "
          f"manifest ({mib(res['manifest'])}) to each host that lacks the tree (flat: every "
          f"host; tree: each gateway's agent, and its relay once, which replays it to its "
          f"leaves), and in the tree a SERVE of {mib(res['serve'])} per leaf (the indices of "
          "the entries it lacks). files' copies = (first sync adds - those frames) / project: "
          "the file data, SSH framing included.\n")
