"""``--dry-run``: the exact plan, printed, with nothing connected or started.

One block per host: how its agent is reached (local, or the SSH target, port, user
and identity file as they resolve through ``~/.ssh/config``, without opening a
socket), the spec the agent would receive (working directory, argv, the environment
every rank of the host shares, then what differs per rank), secret-looking values
and the envelope (it carries the salt) redacted. Six ranks fit on one screen. The
same data, as JSON, is the ``cluster.json`` of ``--log-dir``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..agent.checks import gpu_indices
from ..clusterfile import ClusterSpec
from ..planning.plan import LaunchPlan, coordinator_bind_host
from ..planning.tree import cluster_tree
from ..transport import for_cluster, for_worker
from ..transport.sshconfig import SshSettings
from .output import redact_env


def dry_run_devices(cluster: ClusterSpec) -> dict[str, list[int]]:
    """``local_devices: all`` without connecting: local GPUs are listed, remote ones shown as 0.

    Resolving a remote ``all`` needs its agent, which a dry run never starts; it is
    planned as one GPU and flagged in the output.
    """
    resolved: dict[str, list[int]] = {}
    for w in cluster.workers:
        if w.local_devices != "all":
            continue
        if w.is_local:
            resolved[w.host] = gpu_indices().get("gpus") or [0]
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
                       "bind": coordinator_bind_host(c)},
        "kill_grace": c.kill_grace,
        "master_port": c.master_port,
        "elastic": {"max_failure": c.elastic.max_failure,
                    "formation_timeout": c.elastic.formation_timeout,
                    "heartbeat_timeout": c.elastic.heartbeat_timeout},
        "env": redact_env(dict(c.env)),
        "workers": [
            {"host": w.host, "local": w.is_local, "path": w.path, "addr": w.addr,
             "ssh_target": None, "slurm_job": None, **for_worker(w).details(),
             "tunnel": w.tunnel, "env": redact_env(dict(w.env))}
            for w in c.workers
        ],
        "ranks": [
            {"rank": r.rank, "local_rank": r.local_rank, "host": r.host,
             "device": r.device, "cwd": r.cwd, "argv": list(r.argv),
             "env": redact_env(r.env)}
            for r in plan.ranks
        ],
    }


def dry_run_data(plan: LaunchPlan, settings: Mapping[str, SshSettings]) -> dict[str, Any]:
    """The facts a dry run shows (`words.dry_run_text` lays them out), secrets redacted."""
    c = plan.cluster
    hosts = []
    transports = for_cluster(c, settings)  # a leaf's says which gateway starts it
    for host in plan.hosts():
        worker = next(w for w in c.workers if w.host == host)
        spec = plan.agent_spec(host)
        hosts.append({
            "host": host, "how": transports[host].describe(),
            "all_devices": worker.local_devices == "all" and not worker.is_local,
            "cwd": spec["cwd"], "argv": list(spec["argv"]), "env": redact_env(spec["env"]),
            "ranks": [{"rank": entry["rank"], "env": redact_env(entry["env"]),
                       "device": r.device}
                      for entry, r in zip(spec["ranks"], plan.host_ranks(host))]})
    return {"file": c.file, "world_size": plan.world_size, "controller": c.controller.host,
            "port": c.controller.port, "bind": coordinator_bind_host(c),
            "kill_grace": c.kill_grace, "master_port": c.master_port, "hosts": hosts,
            "tree": cluster_tree(c).as_data()}
