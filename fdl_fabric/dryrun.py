"""``--dry-run``: the exact plan, printed, with nothing connected or started.

It shows what a launch would do on every host: the resolved cluster, each
rank's device and environment (secret-looking values redacted), and the
exact command string each host's session would run. The same data, as JSON,
is the ``cluster.json`` of ``--log-dir``.
"""

from __future__ import annotations

import subprocess
from typing import Any

from . import commands
from .config import ClusterSpec
from .output import redact_env
from .plan import LaunchPlan


def dry_run_devices(cluster: ClusterSpec) -> dict[str, list[int]]:
    """``local_devices: all`` without connecting: local GPUs are listed, remote ones shown as 0.

    Resolving a remote ``all`` needs SSH, which a dry run never opens; it is
    planned as one GPU and flagged in the output.
    """
    resolved: dict[str, list[int]] = {}
    for w in cluster.workers:
        if w.local_devices != "all":
            continue
        if w.is_local:
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=10, check=False)
                resolved[w.host] = [int(x) for x in out.stdout.split() if x.isdigit()] or [0]
            except (OSError, subprocess.TimeoutExpired):
                resolved[w.host] = [0]
        else:
            resolved[w.host] = [0]
    return resolved


def plan_as_json(plan: LaunchPlan) -> dict[str, Any]:
    """The resolved cluster and ranks, secrets redacted (``cluster.json``)."""
    c = plan.cluster
    return {
        "run_id": plan.run_id,
        "file": c.file,
        "controller": {"host": c.controller.host, "port": c.controller.port,
                       "bind": "127.0.0.1" if plan.bind_loopback else c.controller.host},
        "kill_grace": c.kill_grace,
        "master_port": c.master_port,
        "elastic": {"max_failure": c.elastic.max_failure,
                    "formation_timeout": c.elastic.formation_timeout,
                    "heartbeat_timeout": c.elastic.heartbeat_timeout},
        "env": redact_env(dict(c.env)),
        "workers": [
            {"host": w.host, "local": w.is_local, "path": w.path, "addr": w.addr,
             "ssh_target": None if w.is_local else w.ssh_target, "tunnel": w.tunnel,
             "env": redact_env(dict(w.env))}
            for w in c.workers
        ],
        "ranks": [
            {"rank": r.rank, "local_rank": r.local_rank, "host": r.host,
             "device": r.device, "cwd": r.cwd, "argv": list(r.argv),
             "env": redact_env(r.env)}
            for r in plan.ranks
        ],
    }


def describe_dry_run(plan: LaunchPlan) -> str:
    c = plan.cluster
    lines = [f"# dry run of {c.file}: {plan.world_size} rank(s); nothing is connected or started",
             f"controller: {c.controller.host}:{c.controller.port} (coordinator binds "
             f"{'127.0.0.1' if plan.bind_loopback else c.controller.host})",
             f"kill_grace: {c.kill_grace:g}s  master_port: {c.master_port}", ""]
    for w in c.workers:
        ranks = [r for r in plan.ranks if r.host == w.host]
        where = "local (invoke)" if w.is_local else f"ssh {w.ssh_target}"
        note = "  # local_devices: all, resolved with nvidia-smi at launch" \
            if w.local_devices == "all" and not w.is_local else ""
        lines.append(f"host {w.host}: {where}, path {w.path}{note}")
        for r in ranks:
            dev = "cpu" if r.device is None else f"gpu {r.device}"
            lines.append(f"  rank {r.rank} (local {r.local_rank}, {dev})")
            for k, v in redact_env(r.env).items():
                lines.append(f"    {k}={commands.quote(v)}")
            how = "the process environment" if w.is_local else "the session's stdin"
            lines.append(f"    FLODL_INTERNAL_CLUSTER_JSON=<envelope with the salt: sent through "
                         f"{how}, never shown>")
            wrapper = r.wrapper(c.kill_grace)
            command = wrapper if w.is_local else commands.remote_command(wrapper)
            lines.append("    command (" + ("bash -c" if w.is_local else "ssh session") + "):")
            lines.extend("      " + line for line in command.splitlines())
        lines.append("")
    return "\n".join(lines) + "\n"
