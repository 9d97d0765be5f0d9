"""``--dry-run``: the exact plan, printed, with nothing connected or started.

One block per host: how its agent is reached (local, or the SSH target, port, user
and identity file as they resolve through ``~/.ssh/config``, without opening a
socket), the spec the agent would receive (working directory, argv, the environment
every rank of the host shares, then what differs per rank), secret-looking values
and the envelope (it carries the salt) redacted. Six ranks fit on one screen. The
same data, as JSON, is the ``cluster.json`` of ``--log-dir``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from .. import shell
from ..agent.checks import gpu_indices
from ..clusterfile import ClusterSpec
from ..planning.plan import LaunchPlan, coordinator_bind_host
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
             "ssh_target": None if w.is_local or w.slurm_job else w.ssh_target,
             "slurm_job": w.slurm_job, "tunnel": w.tunnel,
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


def _env_words(env: Mapping[str, str]) -> str:
    return " ".join(f"{k}={shell.quote(v)}" for k, v in redact_env(dict(env)).items())


def _ssh_line(settings: SshSettings) -> str:
    """How the host is reached, resolved like the launch would (no socket is opened)."""
    from ..transport.ssh import make_connection

    conn = make_connection(settings)
    parts = [f"ssh {conn.user}@{conn.host} port {conn.port}"]
    if settings.identity_files:
        parts.append("identity " + ", ".join(settings.identity_files))
    else:
        parts.append("identity: ssh-agent and default keys")
    if settings.proxy_jump:
        parts.append(f"via {settings.proxy_jump}")
    return ", ".join(parts)


def _ranks_text(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def describe_dry_run(plan: LaunchPlan, settings: Mapping[str, SshSettings]) -> str:
    c = plan.cluster
    bind = coordinator_bind_host(c)
    hosts = plan.hosts()
    lines = [f"# dry run of {c.file}: {plan.world_size} rank(s) on {len(hosts)} host(s); "
             "nothing is connected or started",
             f"controller {c.controller.host}:{c.controller.port} (coordinator binds {bind}), "
             f"kill_grace {c.kill_grace:g}s, master_port {c.master_port}"]
    for host in hosts:
        worker = next(w for w in c.workers if w.host == host)
        spec = plan.agent_spec(host)
        ranks = plan.host_ranks(host)
        gpus = [str(r.device) for r in ranks if r.device is not None]
        devices = f"gpu {', '.join(gpus)}" if gpus else "cpu"
        if worker.slurm_job is not None:
            from ..transport.slurm import step_argv

            argv = step_argv(worker.slurm_job, host)
            how = ("Slurm node; its agent is an srun step of job "
                   f"{worker.slurm_job}:\n  " + " ".join(shell.quote(w) for w in argv[:-1])
                   + f" <the agent's bootstrap, {len(argv[-1])} bytes: the host's python3 "
                   "-I -S reads the agent from stdin>")
        elif worker.is_local:
            how = f"local, its agent started by invoke ({sys.executable} -I -S)"
        else:
            how = f"{_ssh_line(settings[host])}; one session runs the agent"
        note = "  (local_devices: all, resolved by the agent at launch)" \
            if worker.local_devices == "all" and not worker.is_local else ""
        lines += ["", f"host {host}: {how}",
                  f"  ranks {_ranks_text([r.rank for r in ranks])} ({devices}){note}",
                  f"  cwd {spec['cwd']}",
                  "  argv " + " ".join(shell.quote(a) for a in spec["argv"]),
                  f"  env of every rank: {_env_words(spec['env'])}",
                  "    FLODL_INTERNAL_CLUSTER_JSON=<envelope with the salt: sent on the "
                  "agent's stdin, never shown>"]
        for entry in spec["ranks"]:
            lines.append(f"  rank {entry['rank']}: {_env_words(entry['env'])}")
    return "\n".join(lines) + "\n"
