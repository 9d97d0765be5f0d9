"""``--dry-run``: the exact plan's facts, gathered with nothing connected or started.

One entry per host: how its agent is reached (its `Transport.describe`: local, or the
SSH target, port, user and identity file as they resolve through ``~/.ssh/config``,
without opening a socket), the spec the agent would receive (working directory, argv,
the environment every rank of the host shares, then what differs per rank), secret-
looking values and the envelope (it carries the salt) redacted. The same data, as JSON,
is the ``cluster.json`` of ``--log-dir``.

These are facts, asked of the plan and of each host's transport; the words are
`presentation.dryrunwords`', which never builds a transport or probes a host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from ..agent.gpus import gpu_indices
from ..clusterfile import ClusterSpec
from ..masking import mask_data
from ..planning.plan import LaunchPlan, coordinator_bind_host
from ..presentation.output import redact_env
from ..transport import HostSettings, Transport, for_cluster, for_worker, tree_of


def dry_run_devices(cluster: ClusterSpec) -> dict[str, list[int]]:
    """``local_devices: all`` without connecting: this machine's GPUs are listed, other
    hosts' shown as 0.

    Resolving another host's ``all`` needs its agent, which a dry run never starts; it
    is planned as one GPU and flagged in the output.
    """
    wanted = [w for w in cluster.workers if w.local_devices == "all"]
    if not wanted:
        return {}
    transports = for_cluster(cluster)
    return {w.host: (gpu_indices().get("gpus") or [0]) if transports[w.host].this_machine
            else [0] for w in wanted}


def plan_as_json(plan: LaunchPlan,
                 transports: Optional[Mapping[str, Transport]] = None) -> dict[str, Any]:
    """The resolved cluster and ranks, secrets redacted (``cluster.json``): masked once,
    whole (`masking.mask_data`: every ``env`` by its names and values, every other
    string by its text), and `Masked`, so `runlog.cluster_json` does not walk it again
    (8,192 ranks' environments, masked twice, were a third of cluster.json's CPU)."""
    c = plan.cluster
    transports = transports or for_cluster(c)
    shown: dict[str, Any] = mask_data({
        "run_id": plan.run_id,
        "file": c.file,
        "controller": {"host": c.controller.host, "port": c.controller.port,
                       "bind": coordinator_bind_host(c)},
        "kill_grace": c.kill_grace,
        "master_port": c.master_port,
        "elastic": {"max_failure": c.elastic.max_failure,
                    "formation_timeout": c.elastic.formation_timeout,
                    "heartbeat_timeout": c.elastic.heartbeat_timeout},
        "env": dict(c.env),
        "workers": [_worker_json(w, transports.get(w.host) or for_worker(w))
                    for w in c.workers],
        "ranks": [
            {"rank": r.rank, "local_rank": r.local_rank, "host": r.host,
             "device": r.device, "cwd": r.cwd, "argv": list(r.argv),
             "env": r.env}
            for r in plan.ranks
        ],
    })
    return shown


def _worker_json(w: Any, transport: Transport) -> dict[str, Any]:
    return {"host": w.host, "local": transport.this_machine, "path": w.path,
            "addr": w.addr, "ssh_target": None, "slurm_job": None, **transport.details(),
            "tunnel": transport.tunnels, "env": dict(w.env)}


def dry_run_data(plan: LaunchPlan, settings: HostSettings) -> dict[str, Any]:
    """The facts a dry run shows (`presentation.dryrunwords` lays them out), secrets
    redacted."""
    c = plan.cluster
    transports = for_cluster(c, settings)  # a leaf's says which gateway starts it
    hosts = []
    for host in plan.hosts():
        worker = transports[host].worker
        spec = plan.agent_spec(host)
        hosts.append({
            "host": host, "how": transports[host].describe(),
            "all_devices": worker.local_devices == "all" and not transports[host].this_machine,
            "cwd": spec["cwd"], "argv": list(spec["argv"]), "env": redact_env(spec["env"]),
            "ranks": [{"rank": entry["rank"], "env": redact_env(entry["env"]),
                       "device": r.device}
                      for entry, r in zip(spec["ranks"], plan.host_ranks(host))]})
    return {"file": c.file, "world_size": plan.world_size, "controller": c.controller.host,
            "port": c.controller.port, "bind": coordinator_bind_host(c),
            "kill_grace": c.kill_grace, "master_port": c.master_port, "hosts": hosts,
            "tree": tree_of(c).as_data()}
