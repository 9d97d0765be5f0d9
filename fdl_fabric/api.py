"""The Python API: ``fdl_fabric.launch(...) -> LaunchResult``.

For an ops repo's tasks, a notebook or a test: the same launch as ``inv launch``, but
with a result object instead of an exit code, and exceptions instead of ``sys.exit``.
A configuration mistake (a bad cluster file, flag value or command) raises
`fdl_fabric.errors.FdlError` (a `ConfigError` for the cluster file) with
``exit_code == 2`` before anything is started; everything after that ends in a
`LaunchResult`, whatever failed, as the command line ends in a verdict line.

The console is the command line's (rank output on stdout, the launcher's lines on
stderr) unless ``quiet``; ``on_event`` sees every event as it happens.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

from .clusterfile import ClusterSpec
from .commands.launch import execute
from .commands.options import launch_options
from .errors import EXIT_USAGE, FdlError
from .events import Event, Name, event
from .presentation.words import cause_data, render
from .results import Attempt, LaunchResult, RankOutcome

PathLike = Union[str, "os.PathLike[str]"]


def launch(cluster: Union[PathLike, ClusterSpec, None] = "cluster.yml",
           command: Union[Sequence[str], str, None] = None, *,
           hosts: Optional[str] = None, hostfile: Optional[PathLike] = None,
           ssh_config: Optional[PathLike] = None, user: Optional[str] = None,
           port: Optional[int] = None, identity: Optional[PathLike] = None,
           slurm: bool = False, nproc_per_node: Optional[int] = None,
           master_addr: Optional[str] = None, master_port: Optional[int] = None,
           controller_addr: Optional[str] = None, controller_port: Optional[int] = None,
           rdzv_endpoint: Optional[str] = None,
           max_restarts: Optional[int] = None, max_failure: Union[int, str, None] = None,
           kill_grace: Optional[float] = None, agent_timeout: Optional[float] = None,
           hang_timeout: Optional[float] = None, fanout: Optional[int] = None,
           log_dir: Optional[PathLike] = None, env: Optional[Mapping[str, str]] = None,
           quiet: bool = False, verbosity: int = 0, preflight: bool = True, smoke: bool = False,
           dry_run: bool = False, json: bool = False,
           on_event: Optional[Callable[[Event], None]] = None,
           on_exit: Optional[str] = None, detach: bool = False,
           on: Optional[str] = None, sync: Optional[bool] = None,
           python: Optional[str] = None, trust_ssh_config: bool = False) -> Any:
    """Launch the job of ``cluster`` (a cluster file, or a `ClusterSpec` built in code),
    or of ``hosts``/``hostfile`` (then pass ``cluster=None``), and supervise it to its
    verdict.

    ``command``: the words every rank runs (a string is split like ``--cmd``); default,
    the file's ``command:``. Every other argument is the command line's flag of the same
    name (`commands.vocabulary`), checked by the same code (`commands.options`). Raises
    `FdlError` (exit_code 2) for a configuration mistake, before anything starts.

    ``sync``: True sends the code first (``--sync``), False runs what the hosts have
    (``--no-sync``); None: as the cluster file says.

    ``trust_ssh_config=True``: the ssh_config a cluster file names may run commands
    (``ProxyCommand``, ``Match exec``...), as ``--trust-ssh-config``; refused otherwise
    (docs/security.md).

    ``detach=True``: returns a `handle.RunHandle` once every rank runs under a detached
    supervisor (the run outlives this process); a launch that fails before that raises
    `FdlError` with its exit code, its verdict said on the console. ``on_event`` then
    sees nothing (the supervisor's events are in the run's record). With ``on=HOST``
    too, the supervisor runs on HOST (`commands.onhost`), and a `handle.RemoteRunHandle`
    follows it from here.
    """
    values: dict[str, Any] = {
        "cluster": None if cluster is None or isinstance(cluster, ClusterSpec)
        else os.fspath(cluster),
        "hosts": hosts, "hostfile": _path(hostfile), "ssh_config": _path(ssh_config),
        "user": user, "port": port, "identity": _path(identity), "slurm": slurm,
        "cmd": command if isinstance(command, str) else None,
        "nproc_per_node": nproc_per_node, "master_addr": master_addr,
        "master_port": master_port, "controller_addr": controller_addr,
        "controller_port": controller_port, "rdzv_endpoint": rdzv_endpoint,
        "kill_grace": kill_grace, "max_failure": max_failure, "max_restarts": max_restarts,
        "agent_timeout": agent_timeout, "hang_timeout": hang_timeout, "fanout": fanout,
        "preflight": preflight, "smoke": smoke, "log_dir": _path(log_dir), "dry_run": dry_run,
        "quiet": quiet, "verbose": str(verbosity) if verbosity else None, "json": json,
        "env": dict(env or {}), "on_exit": on_exit, "detach": detach,
        "sync": sync is True, "no_sync": sync is False, "python": python,
        "trust_ssh_config": trust_ssh_config}
    if isinstance(cluster, ClusterSpec) and (hosts or hostfile):
        raise FdlError("hosts: give a ClusterSpec or hosts, not both", EXIT_USAGE)
    words = () if command is None or isinstance(command, str) else list(command)
    opts = launch_options(values, command="launch", argv=words)
    if isinstance(cluster, ClusterSpec):
        opts.cluster, opts.cluster_file = cluster, None
    opts.on_event = on_event
    if on is not None:
        return _detached_on(on, values, words, opts)
    return _run(opts)


def _run(opts: Any) -> Any:
    """The launch of ``opts`` here: its handle when detached, else its result."""
    if opts.detach:
        return _detached(opts)
    launch_ = execute(opts)
    if launch_.refused is not None:
        raise launch_.refused
    if opts.dry_run:  # the plan was said (a `dry_run` event); nothing ran
        return LaunchResult(verdict="dry-run", exit_code=0, message="dry run: nothing was "
                            "connected or started", run_id=None, ranks=(), attempts=(),
                            root_cause=None)
    return result_of(launch_.results, launch_.hosts_of, launch_.run_id)


def _detached(opts: Any) -> Any:
    """``detach=True``: the run's handle once every rank runs."""
    from .commands.detach import detach
    from .handle import RunHandle

    outcome = detach(opts)
    if isinstance(outcome, int):
        raise FdlError(f"the detached launch ended before every rank ran (exit {outcome}); "
                       "its verdict is above", outcome)
    return RunHandle(outcome.run_id, outcome.folder)


def _detached_on(on: str, values: dict[str, Any], words: Sequence[str], opts: Any) -> Any:
    """``detach=True, on=HOST``: the run's supervisor on HOST; its remote handle."""
    from .commands.onhost import launch_there
    from .handle import RemoteRunHandle

    if not opts.detach or opts.cluster is not None and opts.cluster_file is None \
            and not (values.get("hosts") or values.get("hostfile")):
        raise FdlError("on: only with detach=True, and a cluster file or hosts (a "
                       "ClusterSpec built here does not travel)", EXIT_USAGE)
    code, run_id = launch_there(on, values, words, opts.cluster_file)
    if code or run_id is None:
        raise FdlError(f"on: the launch on {on} ended before every rank ran (exit {code})",
                       code or 1)
    return RemoteRunHandle(run_id, on)


def _path(value: Optional[PathLike]) -> Optional[str]:
    return None if value is None else os.fspath(value)


def result_of(results: Sequence[Any], hosts_of: Sequence[tuple[str, ...]],
              run_id: Optional[str]) -> LaunchResult:
    """A launch's attempts (`supervision.RunResult`s) as one `LaunchResult`."""
    if not results:
        raise FdlError("the launch ended before its first attempt")
    final = results[-1]
    shown = next((r for r in reversed(results) if r.started_any), final)
    hosts = [*hosts_of, *[()] * (len(results) - len(hosts_of))]
    line = render(event(Name.VERDICT, cause=cause_data(final.cause), verdict=final.verdict.value,
                        exit_code=final.exit_code))
    return LaunchResult(
        verdict=final.verdict.value, exit_code=final.exit_code, message=line,
        run_id=run_id, ranks=tuple(_outcome(r) for r in shown.ranks),
        attempts=tuple(Attempt(r.verdict.value, r.exit_code, render(r.cause), tuple(h))
                       for r, h in zip(results, hosts)),
        root_cause=_outcome(final.root_cause) if final.root_cause is not None else None)


def _outcome(rank: Any) -> RankOutcome:
    row = rank.summary()
    exit_ = row["exit"] or {}
    return RankOutcome(rank=row["rank"], host=row["host"], state=row["state"],
                       exit_code=exit_.get("code"), signal=exit_.get("signal"),
                       lost=exit_.get("lost"), duration=row["duration"])


__all__ = ["Attempt", "LaunchResult", "RankOutcome", "launch"]
