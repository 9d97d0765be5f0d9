"""Options to resolved settings: everything a launch decides before it contacts a host.

The cluster file, the flags that override it, the command, the SSH options, the
prebuilt binaries and the network time scale are read and checked here, so a mistake
exits 2 with nothing started (`resolve`). A dry run ends here too (`dry_run`): it shows
the plan of the whole roster from the same resolved settings a launch would use.

Also here: the plan of one attempt from its hosts (`plan_attempt`), since the dry run
and every attempt make it the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from .. import shell
from ..clusterfile import ClusterSpec
from ..errors import EXIT_USAGE, FdlError
from ..events import EventBus, Name
from ..planning.envelope import (
    ENV_NET_TIMEOUT_SCALE,
    EnvelopeError,
    PrebuiltBinary,
    new_run_id,
    new_salt,
    prebuilt_from_environ,
)
from ..planning.plan import LaunchPlan, build_plan
from ..runs import place
from ..supervision.membership import Membership
from ..sync.step import CodeStep, never_sent, sync_spec
from ..transport import (
    HostSettings,
    kind_of,
    resolve_cluster,
    resolve_settings,
    with_dialable_addrs,
)
from ..transport.configtrust import inert, with_trust
from .dryrun import dry_run_data, dry_run_devices
from .launchoptions import LaunchOptions, MaxFailure
from .trusted import untrusted


@dataclass
class Resolved:
    """What one launch resolved before contacting any host."""

    cluster: ClusterSpec
    argv: list[str]
    settings: HostSettings
    prebuilt: Mapping[str, PrebuiltBinary]
    launcher_env: dict[str, str]
    scale: float
    max_failure: MaxFailure

    @property
    def lease(self) -> float:
        """Seconds of silence from the launcher after which agents stop their ranks: the
        agents give the launcher what the coordinator gives a rank."""
        return self.cluster.elastic.heartbeat_timeout * self.scale


def load_for(opts: LaunchOptions) -> ClusterSpec:
    """The cluster a launch runs: ``opts.cluster``, the cluster file, or (``--slurm``)
    the nodes of the allocation this runs in (`fdl_fabric.transport.resolve_cluster`)."""
    return resolve_cluster(opts.cluster_file, opts.cluster, slurm=opts.slurm,
                           nproc_per_node=opts.nproc_per_node)


def command_argv(opts: LaunchOptions, cluster: ClusterSpec) -> list[str]:
    """The rank program's argv (see `shell.command_words`); a missing one is exit 2."""
    try:
        return shell.command_words(opts.argv, opts.command, cluster.command)
    except ValueError as exc:
        raise FdlError(f"{cluster.file}: {exc}" if "no command" in str(exc)
                          else f"{cluster.file}: command: {exc}", EXIT_USAGE) from None


def net_timeout_scale(environ: Mapping[str, str]) -> float:
    """FLODL_NET_TIMEOUT_SCALE: a finite float >= 0.1 multiplying every network deadline."""
    raw = environ.get(ENV_NET_TIMEOUT_SCALE, "").strip() or "1"
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not math.isfinite(scale) or scale < 0.1:
        raise FdlError(f"{ENV_NET_TIMEOUT_SCALE}={raw!r} must be a number >= 0.1",
                          EXIT_USAGE)
    return scale


def resolve_max_failure(opts: LaunchOptions, cluster: ClusterSpec) -> MaxFailure:
    """The flag wins over the file; both were parsed when they were read."""
    return cluster.elastic.max_failure if opts.max_failure is None else opts.max_failure


#: Flags that replace the cluster file's key of the same name when given (None: not given).
_OVERRIDES = ("kill_grace", "agent_timeout", "fanout")


def flag_changes(opts: LaunchOptions, cluster: ClusterSpec) -> dict[str, Any]:
    """What the flags change in the cluster file (`dataclasses.replace` keywords): a flag
    given wins over its key."""
    changes: dict[str, Any] = {name: getattr(opts, name) for name in _OVERRIDES
                               if getattr(opts, name) is not None}
    if opts.hang_timeout is not None:  # 0 turns the hang timeout off
        changes["hang_timeout"] = opts.hang_timeout or None
    if opts.max_restarts is not None:
        changes["elastic"] = dataclasses.replace(cluster.elastic,
                                                 max_restarts=opts.max_restarts)
    if opts.on_exit is not None:  # the run's end reads the flag first too (`conclusion`)
        changes["on_exit"] = opts.on_exit
    if opts.python is not None:
        changes["python"] = opts.python
        changes["workers"] = tuple(dataclasses.replace(w, python=None)
                                   for w in cluster.workers)
    return changes


def code_step(opts: LaunchOptions, cluster: ClusterSpec, events: EventBus
              ) -> Optional[CodeStep]:
    """``sync``: the code to send, built now, so a refusal (no src, a link out of it)
    starts nothing. A ``setup`` without ``sync`` is said: it never runs."""
    sync = cluster.sync
    if cluster.setup is not None and sync is None:
        events(Name.SETUP_NOT_RUN)
    if sync is None:
        return None
    code = CodeStep(sync, events, setup=cluster.setup,
                    never=never_sent(str(place.runs_path()), opts.log_dir))
    code.build()
    return code


def trusted_cluster(cluster: ClusterSpec, trust_flag: bool) -> ClusterSpec:
    """The cluster with the ssh_configs its file names allowed to run commands where the
    operator allowed it (`configtrust.with_trust`): ``--trust-ssh-config``, or
    ``ssh.allow_commands: true`` in a cluster file nobody else can change (`untrusted`);
    a refusal is exit 2. Applied before any ssh_config is looked up."""
    if cluster.named_by is not None or not any(w.ssh.config_file for w in cluster.workers):
        return cluster  # the operator's own -F, or none: nothing came with a file
    owned = untrusted(cluster.file) if os.path.isfile(cluster.file) else \
        f"{cluster.file} is not a file of yours"
    return with_trust(cluster, flag=trust_flag, file_untrusted=owned)


def resolve(opts: LaunchOptions, events: EventBus) -> tuple[Resolved, Optional[CodeStep]]:
    """Every input checked (exit 2 on a mistake), nothing contacted: the resolved
    settings, and the code to send (``sync``) if any. A dry run's resolves inside
    `configtrust.inert`: no ssh_config runs anything while it looks hosts up."""
    with inert() if opts.dry_run else contextlib.nullcontext():
        return _resolve(opts, events)


def _resolve(opts: LaunchOptions, events: EventBus) -> tuple[Resolved, Optional[CodeStep]]:
    cluster = with_dialable_addrs(trusted_cluster(load_for(opts), opts.trust_ssh_config))
    changes = flag_changes(opts, cluster)
    sync = sync_spec(cluster, opts.sync)
    if sync != cluster.sync:
        changes["sync"] = sync
    cluster = dataclasses.replace(cluster, **changes) if changes else cluster
    code = code_step(opts, cluster, events)
    max_failure = resolve_max_failure(opts, cluster)
    argv = command_argv(opts, cluster)
    settings = resolve_settings(cluster, events)
    try:
        prebuilt = prebuilt_from_environ()
    except EnvelopeError as exc:
        raise FdlError(str(exc), EXIT_USAGE) from None
    launcher_env = dict(os.environ)
    launcher_env.update(opts.env_overrides)
    scale = net_timeout_scale(launcher_env)
    return Resolved(cluster, argv, settings, prebuilt, launcher_env, scale,
                    max_failure), code


def membership_for(cluster: ClusterSpec) -> Membership:
    """The membership rule of a cluster: its roster, its spares, its min_hosts."""
    return Membership(roster=[w.host for w in cluster.workers if not w.spare],
                      spares=[w.host for w in cluster.workers if w.spare],
                      min_hosts=cluster.elastic.min_hosts,
                      host_failures=cluster.elastic.host_failures)


def attempt_cluster(cluster: ClusterSpec, hosts: Sequence[str]) -> ClusterSpec:
    """The cluster of one attempt: its hosts in roster order, numbered afresh (each
    worker's index is its GROUP_RANK)."""
    by_host = {w.host: w for w in cluster.workers}
    return dataclasses.replace(cluster, workers=tuple(
        dataclasses.replace(by_host[h], index=i) for i, h in enumerate(hosts)))


def plan_attempt(r: Resolved, cluster: ClusterSpec, resolved: Mapping[str, list[int]], *,
                 run_id: Optional[str] = None, attempt: int = 0) -> LaunchPlan:
    """The plan of one attempt, from its hosts: ranks numbered afresh, a fresh salt
    every time, so nothing of an earlier attempt can join this one's cohort; the run
    id stays (TORCHELASTIC_RUN_ID)."""
    try:
        return build_plan(cluster, argv=r.argv, run_id=run_id or new_run_id(),
                          salt=new_salt(), resolved_devices=resolved, prebuilt=r.prebuilt,
                          launcher_env=r.launcher_env, attempt=attempt)
    except ValueError as exc:
        raise FdlError(f"{r.cluster.file}: {exc}", EXIT_USAGE) from None


def dry_run(r: Resolved, membership: Membership, code: Optional[CodeStep],
            events: EventBus) -> None:
    """``--dry-run``: the plan of the whole roster, shown; nothing is contacted, and no
    ssh_config runs anything while its hosts are described (`configtrust.inert`)."""
    with inert():
        _dry_run(r, membership, code, events)


def _dry_run(r: Resolved, membership: Membership, code: Optional[CodeStep],
             events: EventBus) -> None:
    join = r.cluster.controller.join
    if join is not None:  # the window's world is who dials in: the window said, then the rest
        joining = [w.host for w in r.cluster.workers if kind_of(w).dials_in]
        events(Name.JOIN_WINDOW_PLANNED, address=f"{join.bind or r.cluster.controller.host}:"
               f"{join.port}", quorum=join.min_ranks, target=join.target_ranks,
               window=join.join_timeout * r.scale, cap=join.max_join_timeout * r.scale,
               start=join.start.value, discovery=join.discovery, joining=joining,
               token_file=join.token_file)
        others = tuple(w for w in r.cluster.workers if w.host not in joining)
        if not others:
            return
        r = dataclasses.replace(r, cluster=dataclasses.replace(r.cluster, workers=others))
        membership = membership_for(r.cluster)
    roster = attempt_cluster(r.cluster, membership.roster)
    if code is not None:
        roster = code.planned(roster)
    plan = plan_attempt(r, roster, dry_run_devices(roster))
    events(Name.DRY_RUN, **dry_run_data(plan, r.settings), spares=list(membership.spares),
           min_hosts=r.cluster.elastic.min_hosts, code=code.dry_run() if code else None,
           **programs_shown(r.cluster, code))


def programs_shown(cluster: ClusterSpec, code: Optional[CodeStep]) -> dict[str, Any]:
    """The commands besides the ranks' that the file (or ``--on-exit``) names, as a dry
    run shows them and never runs them: ``setup`` (run on each host after the sync;
    None without ``sync:``, which never runs it) and ``on_exit`` (run here when the run
    ends)."""
    setup = cluster.setup if code is not None else None
    return {"setup": None if setup is None else {
                "command": setup.command, "inputs": list(setup.inputs),
                "timeout": setup.timeout},
            "on_exit": cluster.on_exit}
