"""One front door: the flags of any command, as given, to what the command works on.

``inv launch``, ``fdl-fabric launch``, ``fdl-fabric run`` and the Python API all build
their `LaunchOptions` here, and ``status``, ``stacks``, ``cleanup`` and
``prebuild-check`` their hosts, so a flag means one thing everywhere and is checked in
one place (each value by `commands.flags`, before anything is read, looked up or
started). Values arrive as the command line gives them: strings, booleans, None for a
flag not given, keyed by the flag's Python name (`commands.vocabulary`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from ..clusterfile import (
    MASTER_PORT_DEFAULT,
    ClusterSpec,
    ControllerSpec,
    ElasticSpec,
    SshSpec,
    WorkerSpec,
)
from ..clusterfile.hosts import HostsError, HostSlot, cluster_from_hosts
from ..errors import EXIT_USAGE, FdlError, usage
from . import flags
from .launchoptions import LaunchOptions

#: ``fdl-fabric run``'s kill grace: torchrun's (its agent waits 30 s after SIGTERM).
RUN_KILL_GRACE = 30.0

#: Flags that describe hosts given on the command line; with a cluster file they are
#: refused (the file says it per worker), never ignored.
_HOSTS_ONLY = ("ssh_config", "user", "port", "identity")
#: Flags that place the rendezvous; with a cluster file, ``controller:`` and
#: ``master_port:`` say it.
_RENDEZVOUS = ("master_addr", "master_port", "controller_addr", "controller_port",
               "rdzv_endpoint")


def launch_options(values: Mapping[str, Any], *, command: str, argv: Sequence[str] = (),
                   settings: Optional[Mapping[str, str]] = None) -> LaunchOptions:
    """A launch from its flags (``command`` is ``launch`` or ``run``; ``argv``, the rank's
    words when given as words). Raises `FdlError` (exit 2) naming the flag."""
    v = _Values(values)
    settings = settings or {}
    per_node = flags.nproc_words(v.get("nproc_per_node"), this_machine=command == "run")
    grace = flags.seconds("--kill-grace", v.get("kill_grace"))
    common = _common(v, argv, settings)
    if common["detach"] and common["dry_run"]:
        raise usage("--detach", "a dry run starts nothing to detach from: drop one")
    if common["smoke"] and not common["preflight"]:
        raise usage("--smoke", "it is part of the pre-flight, which --no-preflight turns off: "
                    "drop one")
    # A dry run runs nothing of an ssh_config, even while -F's aliases are looked up.
    with _inert() if common["dry_run"] else contextlib.nullcontext():
        from_hosts = hosts_cluster(values, command=command, nproc_per_node=per_node,
                                   launching=True)
    if from_hosts is not None:
        if command == "run":
            from_hosts = _with_nnodes(from_hosts, v.get("nnodes"))
            grace = RUN_KILL_GRACE if grace is None else grace
        return LaunchOptions(cluster_file=None, cluster=from_hosts, kill_grace=grace,
                             **common)  # type: ignore[arg-type]
    if command == "run" and v.get("cluster") is None:
        cluster = _this_machine(v, per_node)
        return LaunchOptions(cluster_file=None, cluster=cluster,
                             kill_grace=RUN_KILL_GRACE if grace is None else grace,
                             **common)  # type: ignore[arg-type]
    return _file_launch(v, command, settings, per_node, grace, common)


def _inert() -> contextlib.AbstractContextManager[None]:
    """`transport.configtrust.inert`, imported only for a dry run: the options of a
    ``--detach`` front load no transport."""
    from ..transport.configtrust import inert

    return inert()


def _common(v: _Values, argv: Sequence[str], settings: Mapping[str, str]
            ) -> dict[str, Any]:
    """The options every launch has, whatever names its hosts."""
    return dict(
        command=flags.command(v.get("cmd")), argv=list(argv),
        verbosity=1 + flags.verbosity(v.get("verbose")), quiet=bool(v.get("quiet")),
        max_failure=flags.max_failure(v.get("max_failure")),
        max_restarts=flags.restarts("--max-restarts", v.get("max_restarts")),
        log_dir=flags.log_dir(v.get("log_dir") or settings.get("log_dir") or None),
        dry_run=bool(v.get("dry_run")), preflight=v.get("preflight") is not False,
        smoke=bool(v.get("smoke")),
        agent_timeout=flags.agent_timeout(v.get("agent_timeout")),
        hang_timeout=flags.seconds("--hang-timeout", v.get("hang_timeout")),
        fanout=flags.fanout(v.get("fanout")), json=bool(v.get("json")),
        env_overrides=dict(v.get("env") or {}),
        on_exit=flags.on_exit(v.get("on_exit")), detach=bool(v.get("detach")),
        sync=_sync_choice(v), python=flags.python(v.get("python")),
        trust_ssh_config=bool(v.get("trust_ssh_config")))


def _file_launch(v: _Values, command: str, settings: Mapping[str, str],
                 per_node: Optional[int], grace: Optional[float],
                 common: dict[str, Any]) -> LaunchOptions:
    """A launch of a cluster file (or of ``--slurm``'s allocation)."""
    slurm = bool(v.get("slurm"))
    if command == "run" and _nnodes(v.get("nnodes")) != (0, 0):
        raise usage("--nnodes", "with --cluster the file says it (elastic.min_hosts, "
                    "spare: true)")
    return LaunchOptions(
        # --slurm reads a cluster file only when one is named: the flags can say it all.
        cluster_file=None if slurm and v.get("cluster") is None
        else flags.cluster_file(v.get("cluster"), settings.get("cluster", "cluster.yml")),
        slurm=slurm, nproc_per_node=per_node, kill_grace=grace,
        **common)  # type: ignore[arg-type]


def _sync_choice(v: _Values) -> Optional[bool]:
    """``--sync`` True, ``--no-sync`` False, neither None (the cluster file says)."""
    if v.get("sync") and v.get("no_sync"):
        raise usage("--sync", "give --sync or --no-sync, not both")
    return True if v.get("sync") else False if v.get("no_sync") else None


def hosts_cluster(values: Mapping[str, Any], *, command: str,
                  nproc_per_node: Optional[int] = None,
                  launching: bool = False) -> Optional[ClusterSpec]:
    """The cluster that ``--hosts``/``--hostfile`` stand for, with ``-F``, ``--user``,
    ``--port``, ``--identity`` and, for a launch, the rendezvous flags; None when neither
    is given (the other host flags are then refused, naming the cluster file's key). The
    launch's other flags (kill grace, restarts...) stay in `LaunchOptions`, which the
    launch applies over any cluster, a file's or this one."""
    v = _Values(values)
    hosts, hostfile = v.get("hosts"), v.get("hostfile")
    if hosts is None and hostfile is None:
        _refuse_with_file(v, "one host" if command == "run" and v.get("cluster") is None
                          else "a cluster file")
        return None
    _refuse_two_sources(v)
    ssh = flags.ssh_defaults(v.get("ssh_config"), v.get("user"), v.get("port"),
                             v.get("identity"))
    slots = flags.host_slots(hosts, hostfile)
    top: dict[str, Any] = {}
    addrs: dict[str, str] = {}
    if launching:
        top, first_addr = _rendezvous(v, slots, ssh.config_file)
        if first_addr is not None:
            addrs[slots[0].host] = first_addr
    high = (_nnodes(v.get("nnodes"))[1] or None) if command == "run" else None
    try:
        return cluster_from_hosts(slots, nproc_per_node=nproc_per_node, ssh=ssh,
                                  source="--hosts" if hosts is not None else str(hostfile),
                                  max_hosts=high, addrs=addrs, **top)
    except HostsError as exc:
        raise FdlError(str(exc), EXIT_USAGE) from None


def _refuse_two_sources(v: _Values) -> None:
    """The hosts come from one place: ``--hosts`` or ``--hostfile``, and not with a
    cluster file or ``--slurm``."""
    hosts, hostfile = v.get("hosts"), v.get("hostfile")
    if hosts is not None and hostfile is not None:
        raise usage("--hosts", "give --hosts or --hostfile, not both")
    if v.get("cluster") is not None or v.get("slurm"):
        raise usage("--hosts" if hosts is not None else "--hostfile",
                    "the hosts come from the command line or from "
                    f"{'--slurm' if v.get('slurm') else '--cluster'}, not both")


def _rendezvous(v: _Values, slots: Sequence[HostSlot],
                config_file: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
    """Where the ranks meet: the coordinator on this machine (its address toward the first
    host, a free port) and MASTER_ADDR:PORT on the first host, each unless given. Returns
    the cluster keys and the first host's address when ``--master-addr`` gave it (the
    others' are the names ssh dials: `sshconfig.with_dialable_addrs`, at the launch)."""
    addrs = {s.host: flags.dialed(s.host, config_file) for s in slots}
    rdzv_host, rdzv_port = _rdzv_endpoint(v)
    master_addr = flags.address("--master-addr", v.get("master_addr"))
    first = slots[0].host
    first_addr = master_addr or addrs.get(first, first)
    controller_host = flags.address("--controller-addr", v.get("controller_addr")) \
        or rdzv_host or flags.controller_toward(first_addr)
    # The coordinator's port and rank 0's store port, when both are picked here, are
    # picked together: never the same port twice.
    free = iter(flags.free_ports(2))
    controller_port = flags.port("--controller-port", v.get("controller_port")) \
        or rdzv_port or next(free)
    master_port = flags.port("--master-port", v.get("master_port"))
    if master_port is None:
        here = all(flags.is_this_machine(addrs.get(s.host, s.host)) for s in slots) \
            and flags.is_this_machine(first_addr)
        master_port = next(free) if here else MASTER_PORT_DEFAULT
    top: dict[str, Any] = {"master_port": master_port,
                           "controller": {"port": controller_port}}
    if controller_host is not None:
        top["controller"]["host"] = controller_host
    return top, master_addr


def _rdzv_endpoint(v: _Values) -> tuple[Optional[str], Optional[int]]:
    """``--rdzv-endpoint HOST:PORT``, (None, None) when not given; refused with
    ``--controller-addr`` or ``--controller-port``, which say the same."""
    endpoint = v.get("rdzv_endpoint")
    if not endpoint:
        return None, None
    given = flags.endpoint("--rdzv-endpoint", endpoint)
    for flag in ("controller_addr", "controller_port"):
        if v.get(flag) is not None:
            raise usage("--rdzv-endpoint", f"give it or --{flag.replace('_', '-')}, not both")
    return given


def _refuse_with_file(v: _Values, where: str) -> None:
    """A host or rendezvous flag without ``--hosts``: refused, with what to use instead."""
    for name in _HOSTS_ONLY + _RENDEZVOUS:
        if v.get(name) is None or (where == "one host" and name in ("master_addr",
                                                                    "master_port")):
            continue
        flag = "--" + name.replace("_", "-")
        if name == "user":
            raise usage("-l/--user", "only with --hosts or --hostfile (a cluster file sets "
                        "ssh.user per worker; -l is no longer --log-dir: write --log-dir)")
        if where == "one host":
            raise usage(flag, "only with --hosts or --hostfile: `fdl-fabric run` without "
                        "them runs on this machine")
        key = {"ssh_config": "ssh.config_file", "port": "ssh.port",
               "identity": "ssh.identity_file", "master_addr": "addr of the first worker",
               "master_port": "master_port",
               "controller_addr": "controller.host", "controller_port": "controller.port",
               "rdzv_endpoint": "controller.host and controller.port"}[name]
        raise usage(flag, f"only with --hosts or --hostfile ({where} sets {key})")


def _nnodes(text: Optional[str]) -> tuple[int, int]:
    """torchrun's ``--nnodes N`` or ``MIN:MAX``; (0, 0) for the default, 1."""
    if text is None or text.strip() in ("1", "1:1"):
        return 0, 0
    return flags.nnodes(text)


def _with_nnodes(cluster: ClusterSpec, text: Optional[str]) -> ClusterSpec:
    """``--nnodes MIN:MAX`` on ``run --hosts``: ``elastic.min_hosts`` (the spares were set
    when the hosts were read)."""
    low, _ = _nnodes(text)
    roster = sum(1 for w in cluster.workers if not w.spare)
    if low and low > roster:
        raise usage("--nnodes", f"MIN is {low}, but only {roster} host(s) were given")
    if not low:
        return cluster
    return dataclasses.replace(cluster, elastic=dataclasses.replace(cluster.elastic,
                                                                    min_hosts=low))


def _this_machine(v: _Values, per_node: Optional[int]) -> ClusterSpec:
    """``fdl-fabric run`` without hosts: this machine, in this folder, every port free."""
    if _nnodes(v.get("nnodes")) != (0, 0):
        raise usage("--nnodes", f"`fdl-fabric run` without --hosts is this machine, got "
                    f"{v.get('nnodes')!r}: give the hosts with --hosts or --hostfile")
    master_port = flags.port("--master-port", v.get("master_port"))
    addr = flags.address("--master-addr", v.get("master_addr")) or "127.0.0.1"
    coordinator_port, free_master = flags.free_ports(2)
    cwd = os.getcwd()
    worker = WorkerSpec(index=0, host="localhost", nproc=per_node or 1,
                        local_devices=None, path=cwd, addr=addr,
                        nccl_socket_ifname=None, ssh=SshSpec(), tunnel=False, env={},
                        data_path=None, is_local=True, line=0)
    return ClusterSpec(
        file="fdl-fabric run", folder=cwd,
        controller=ControllerSpec(host="127.0.0.1", port=coordinator_port),
        command=None, env={}, kill_grace=RUN_KILL_GRACE,
        master_port=master_port or free_master,
        elastic=ElasticSpec(max_restarts=flags.restarts("--max-restarts",
                                                        v.get("max_restarts")) or 0),
        workers=(worker,),
        # Each run is a cluster of its own: two jobs started from one folder never see
        # each other as leftovers.
        key=f"run-{secrets.token_hex(8)}")


def refuse(exc: FdlError, command: Optional[str], *, as_json: bool = False) -> None:
    """Say a refusal the way every event is said: one line on stderr, and under
    ``--json`` its record on stdout too (`presentation.output.JsonConsole`)."""
    from ..events import EventBus, Name
    from ..presentation.output import Console, JsonConsole

    console = JsonConsole() if as_json else Console()
    EventBus(console)(Name.REFUSED, command=command, error=str(exc))


class _Values:
    """The flags as given: a missing key, None and False all mean "not given"."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = values

    def get(self, name: str) -> Any:
        value = self._values.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # the API's numbers, checked as the command line's words
        return value


__all__ = ["MASTER_PORT_DEFAULT", "RUN_KILL_GRACE", "hosts_cluster", "launch_options",
           "refuse"]
