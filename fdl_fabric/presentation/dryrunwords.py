"""The words of a dry run (``--dry-run``): what each host would be sent, laid out.

Part of the one renderer (`presentation.words`, which gives `Name.DRY_RUN` these
words); a module of its own only because it is a view of its own, a page long.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from .. import shell
from ..masking import mask_env, mask_text
from .codewords import size


def dry_run_text(d: Mapping[str, Any]) -> str:
    """``--dry-run``: one block per host (how its agent is reached, the spec it would get:
    cwd, argv, the environment its ranks share, then what differs per rank), the envelope
    already left out of the facts (`dryrun.dry_run_data`). Secrets are hidden here too,
    whatever the facts hid (`masking`: by name, ``secret_env`` and by value), so the
    words a dry run shows can never say more than the rule allows."""
    lines = [f"# dry run of {d['file']}: {d['world_size']} rank(s) on {len(d['hosts'])} "
             "host(s); nothing is connected or started",
             f"controller {d['controller']}:{d['port']} (coordinator binds {d['bind']}), "
             f"kill_grace {d['kill_grace']:g}s, master_port {d['master_port']}"]
    lines += _tree_words(d.get("tree") or {})
    lines += _code_words(d.get("code"))
    if d.get("setup"):
        lines.append("setup (each host, after the sync; a dry run runs none): "
                     f"{d['setup']['command']}")
    if d.get("on_exit"):
        lines.append(f"on_exit (here, when the run ends; a dry run runs none): {d['on_exit']}")
    for host in d["hosts"]:
        ranks = host["ranks"]
        gpus = [str(r["device"]) for r in ranks if r["device"] is not None]
        devices = f"gpu {', '.join(gpus)}" if gpus else "cpu"
        note = "  (local_devices: all, resolved by the agent at launch)" \
            if host["all_devices"] else ""
        numbers = [r["rank"] for r in ranks]
        span = f"{numbers[0]}-{numbers[-1]}" if len(numbers) > 1 else str(numbers[0])
        lines += ["", f"host {host['host']}: {host['how']}",
                  f"  ranks {span} ({devices}){note}",
                  f"  cwd {host['cwd']}",
                  "  argv " + " ".join(shell.quote(a) for a in host["argv"]),
                  f"  env of every rank: {_env_words(host['env'])}",
                  "    FLODL_INTERNAL_CLUSTER_JSON=<envelope with the salt: sent on the "
                  "agent's stdin, never shown>"]
        lines += [f"  rank {r['rank']}: {_env_words(r['env'])}" for r in ranks]
    if d.get("spares"):
        lines += ["", f"spares (started only in place of a lost host): {', '.join(d['spares'])}"]
    if d.get("min_hosts") is not None:
        lines += [f"min_hosts {d['min_hosts']}: an attempt starts with at least that many "
                  "hosts"]
    return mask_text("\n".join(lines)) + "\n"


#: Files of a sync a dry run names (``--json`` has them all).
_FILES_SHOWN = 20


def _code_words(code: Optional[Mapping[str, Any]]) -> list[str]:
    """``sync``: what each host would receive at most (a host that has some of it
    receives only the rest; none is asked: a dry run connects nowhere)."""
    if not code:
        return []
    listed = code["list"]
    lines = [f"code {code['code_id']} from {code['src']}: each host receives what it lacks of "
             f"{code['files']:,} file(s), {size(code['bytes'])} (all of it, the first time), "
             f"into <path>/.fdl-code/trees/{code['tree']}"]
    lines += [f"  {rel}  {size(n)}" for rel, n in listed[:_FILES_SHOWN]]
    if len(listed) > _FILES_SHOWN:
        lines.append(f"  ... and {len(listed) - _FILES_SHOWN:,} more (--json lists them all)")
    if code.get("excluded"):
        lines.append(f"  {code['excluded']:,} file(s) left out by the ignore rules")
    return lines


def _tree_words(tree: Mapping[str, Any]) -> list[str]:
    """The gateway tree of a dry run: which gateway starts which leaves (none: flat)."""
    gateways = tree.get("gateways") or {}
    if not gateways:
        return []
    lines = [f"gateway tree (fanout {tree['fanout']}): the launcher connects to "
             f"{len(gateways)} gateway(s); each starts its leaves with ssh"]
    for gateway, leaves in gateways.items():
        lines.append(f"  {gateway} -> {len(leaves)} leaves: {', '.join(leaves)}")
    return lines


def _env_words(env: Mapping[str, str]) -> str:
    return " ".join(f"{k}={shell.quote(v)}" for k, v in mask_env(env).items())
