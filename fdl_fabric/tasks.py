"""The Invoke task collection: ``inv launch`` and friends.

Import it into another repo's tasks.py with
``ns.add_collection(fdl_fabric.tasks.ns, "fdl")``; the root ``tasks.py`` of
this repo and the ``fdl-fabric`` console script use the same collection.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from invoke.collection import Collection
from invoke.context import Context
from invoke.exceptions import Exit
from invoke.tasks import Task, task

from .commands import flags
from .commands.cleanup import run_cleanup
from .commands.launch import LaunchOptions
from .commands.launch import launch as run_launch
from .commands.stacks import run_stacks
from .commands.status import run_status
from .errors import FdlError
from .events import EventBus, Name
from .preflight import check_cluster
from .presentation.output import Console
from .presentation.plot import plot_run as draw


class _ChosenShortFlags(Task[Any]):
    """A task whose short flags are chosen, not derived from letters: invoke's automatic
    ones gave ``inv launch`` ``-m`` for ``--cmd`` (torchrun's ``-m`` is a module), ``-n``
    for ranks per host (srun's ``-n`` is total tasks) and ``-h`` for ``--hang-timeout``."""

    SHORT: dict[str, str] = {}

    def arg_opts(self, name: str, default: str, taken_names: set[str]) -> dict[str, Any]:
        opts: dict[str, Any] = super().arg_opts(name, default, taken_names)
        opts["names"] = opts["names"][:1] + ([self.SHORT[name]] if name in self.SHORT else [])
        return opts


class _LaunchTask(_ChosenShortFlags):
    SHORT = {"cluster": "c", "dry_run": "d", "json": "j", "kill_grace": "k", "log_dir": "l",
             "quiet": "q", "verbose": "v", "hosts": "H", "ssh_config": "F"}


#: Defaults for the ``fdl`` config section: set them in invoke.yaml / fabric.yaml
#: (``fdl: {cluster: lab.yml, log_dir: runs/logs}``) or the environment
#: (``INVOKE_FDL_CLUSTER=lab.yml``); command-line flags win.
CONFIG_DEFAULTS = {"cluster": "cluster.yml", "log_dir": ""}


def _cluster_file(c: Context, cluster: Optional[str]) -> str:
    """The ``--cluster`` flag (or the configured default), checked: a bad one is exit 2
    with one line, as every usage error of these tasks."""
    try:
        return flags.cluster_file(cluster, _settings(c)["cluster"])
    except FdlError as exc:
        raise Exit(str(exc), code=exc.exit_code) from None


def _settings(c: Context) -> dict[str, str]:
    section = c.config.get("fdl", {}) or {}
    return {key: section.get(key, default) or default for key, default in CONFIG_DEFAULTS.items()}


def _remainder() -> list[str]:
    """Words after a standalone ``--`` on the command line, exactly as typed.

    invoke joins its remainder into one string, which loses the quoting of
    each word; the process argv still has it.
    """
    if "--" in sys.argv:
        return sys.argv[sys.argv.index("--") + 1:]
    return []


def launch_options(settings: dict[str, str], *, cluster: Optional[str] = None,
                   cmd: Optional[str] = None, kill_grace: Optional[str] = None,
                   quiet: bool = False, verbose: Optional[str] = None,
                   max_failure: Optional[str] = None, max_restarts: Optional[str] = None,
                   log_dir: Optional[str] = None, dry_run: bool = False,
                   preflight: bool = True, slurm: bool = False,
                   nproc_per_node: Optional[str] = None, agent_timeout: Optional[str] = None,
                   hang_timeout: Optional[str] = None, hosts: Optional[str] = None,
                   hostfile: Optional[str] = None,
                   ssh_config: Optional[str] = None,
                   fanout: Optional[str] = None) -> LaunchOptions:
    """The launch's options from the flags as invoke gives them, every one checked: a bad
    value is a FdlError (exit 2) naming its flag, before anything is read or started."""
    per_node = flags.nproc_per_node("--nproc-per-node", nproc_per_node)
    from_hosts = flags.hosts_cluster(hosts, hostfile, ssh_config, per_node,
                                     cluster_given=cluster is not None or slurm)
    if from_hosts is not None:
        return LaunchOptions(
            cluster_file=None, cluster=from_hosts, command=flags.command(cmd),
            argv=_remainder(), kill_grace=flags.seconds("--kill-grace", kill_grace),
            verbosity=1 + flags.verbosity(verbose), quiet=quiet,
            max_failure=flags.max_failure(max_failure),
            max_restarts=flags.restarts("--max-restarts", max_restarts),
            log_dir=flags.log_dir(log_dir or settings["log_dir"] or None), dry_run=dry_run,
            preflight=preflight, agent_timeout=flags.agent_timeout(agent_timeout),
            hang_timeout=flags.seconds("--hang-timeout", hang_timeout),
            fanout=flags.fanout(fanout))
    return LaunchOptions(
        # --slurm reads a cluster file only when one is named: the flags can say it all.
        cluster_file=None if slurm and cluster is None
        else flags.cluster_file(cluster, settings["cluster"]),
        command=flags.command(cmd),
        argv=_remainder(),
        kill_grace=flags.seconds("--kill-grace", kill_grace),
        verbosity=1 + flags.verbosity(verbose),
        quiet=quiet,
        max_failure=flags.max_failure(max_failure),
        max_restarts=flags.restarts("--max-restarts", max_restarts),
        log_dir=flags.log_dir(log_dir or settings["log_dir"] or None),
        dry_run=dry_run,
        preflight=preflight,
        slurm=slurm,
        nproc_per_node=per_node,
        agent_timeout=flags.agent_timeout(agent_timeout),
        hang_timeout=flags.seconds("--hang-timeout", hang_timeout),
        fanout=flags.fanout(fanout),
    )


@task(
    klass=_LaunchTask,
    help={
        "cluster": "cluster file (default: cluster.yml)",
        "cmd": "command to run on every rank (default: `command:` of the cluster file); "
        "or give the words after `--`",
        "kill-grace": "seconds between TERM and KILL when stopping ranks (default: kill_grace)",
        "quiet": "show only launcher status and events, not rank output",
        "verbose": "more detail: -v, -vv, or --verbose=N (1-3); also sets FLODL_VERBOSITY "
        "for the ranks",
        "log-dir": "keep <dir>/<run_id>/attempt_<k>/r<rank>/{stdout,stderr}.log, "
        "events.jsonl and cluster.json",
        "dry-run": "print each host's agent spec and how it is reached; connect nowhere",
        "preflight": "check paths, program and port on every host before starting any "
        "rank (default); --no-preflight skips it",
        "max-failure": "after the cohort forms, stop the run once this many ranks died "
        "(a count, or a percentage such as 25%); default: elastic.max_failure",
        "max-restarts": "start the whole group again up to N times after a failure, as "
        "torchrun does (default: elastic.max_restarts, 0)",
        "slurm": "run on the nodes of the Slurm allocation this runs in (salloc, sbatch), "
        "one agent per node started by srun; reads a cluster file only with --cluster",
        "nproc-per-node": "ranks on each host of --hosts (default 1; a hostfile's slots=N "
        "wins), or on each Slurm node (default: nproc_per_node of the cluster file)",
        "hosts": "the hosts, without a cluster file: node[1-4],gpu[01-02] (Slurm and "
        "ClusterShell ranges), in rank order",
        "hostfile": "the hosts from a DeepSpeed/MPI hostfile: `host slots=N` per line",
        "ssh-config": "with --hosts/--hostfile: an ssh_config file read instead of "
        "~/.ssh/config (like ssh -F): user, port, key, ProxyJump per host",
        "agent-timeout": "seconds without a word from a host's agent after which the host is "
        "unresponsive and its ranks lost (default: agent_timeout, 10)",
        "hang-timeout": "seconds without output or progress from any rank after which the "
        "run is hung: every rank's stack is shown, exit 1 (default: hang_timeout, off; "
        "0 turns it off)",
        "json": "every event as one JSON line on stdout, rank output included, the verdict "
        "last (docs/cli.md); the operator's lines stay on stderr",
        "fanout": "SSH hosts the launcher reaches itself (default: fanout, 64); beyond it, "
        "about sqrt(hosts) of them are gateways that start the rest with ssh",
    },
    optional=["verbose"],
)
def launch(
    c: Context,
    cluster: Optional[str] = None,
    cmd: Optional[str] = None,
    kill_grace: Optional[str] = None,
    quiet: bool = False,
    verbose: Optional[str] = None,
    max_failure: Optional[str] = None,
    max_restarts: Optional[str] = None,
    log_dir: Optional[str] = None,
    dry_run: bool = False,
    preflight: bool = True,
    slurm: bool = False,
    nproc_per_node: Optional[str] = None,
    agent_timeout: Optional[str] = None,
    hang_timeout: Optional[str] = None,
    json: bool = False,
    hosts: Optional[str] = None,
    hostfile: Optional[str] = None,
    ssh_config: Optional[str] = None,
    fanout: Optional[str] = None,
) -> None:
    """Launch the job described by the cluster file and supervise it to a verdict.

    Exit codes: 0 ok (or degraded), 1 run failure, 2 config or usage error,
    130/143 interrupted by SIGINT/SIGTERM.
    """
    try:
        opts = launch_options(_settings(c), cluster=cluster, cmd=cmd, kill_grace=kill_grace,
                              quiet=quiet, verbose=verbose, max_failure=max_failure,
                              max_restarts=max_restarts, log_dir=log_dir, dry_run=dry_run,
                              preflight=preflight, slurm=slurm, nproc_per_node=nproc_per_node,
                              agent_timeout=agent_timeout, hang_timeout=hang_timeout,
                              hosts=hosts, hostfile=hostfile, ssh_config=ssh_config,
                              fanout=fanout)
    except FdlError as exc:
        raise Exit(str(exc), code=exc.exit_code) from None
    opts.json = json
    code = run_launch(opts)
    if code:
        raise Exit(code=code)


@task(
    help={
        "cluster": "cluster file whose hosts are swept (default: cluster.yml)",
        "run-id": "stop only this run's ranks",
        "all": "stop every recorded run of this user, not only this cluster's",
        "pattern": "ALSO stop processes whose command line matches this regex, like "
        "`pkill -f` (TERM, 1 s, KILL); may hit processes fdl-fabric did not start",
        "slurm": "sweep every node of the Slurm allocation this runs in, for this job's "
        "runs only, and cancel this job's leftover agent steps",
        "force": "also stop runs whose launcher is alive (without it they are left alone, "
        "unless named with --run-id)",
    },
    name="cleanup",
)
def cleanup(
    c: Context,
    cluster: Optional[str] = None,
    run_id: Optional[str] = None,
    all: bool = False,
    pattern: Optional[str] = None,
    slurm: bool = False,
    force: bool = False,
) -> None:
    """Stop leftover ranks on every host of the cluster, then verify none remains.

    Only processes of runs recorded by fdl-fabric's agents are stopped: a rank's
    process group while its leader is the one the agent started, and processes that
    carry the run's id. A run whose launcher is alive is left alone unless named with
    --run-id or --force is given. Exit 1 if anything survives.
    """
    file = cluster if slurm else _cluster_file(c, cluster)
    try:
        pattern = flags.pattern(pattern)
    except FdlError as exc:
        raise Exit(str(exc), code=exc.exit_code) from None
    code = run_cleanup(file, run_id=run_id, all_runs=all, pattern=pattern, slurm=slurm,
                       force=force)
    if code:
        raise Exit(code=code)


@task(
    help={
        "cluster": "cluster file whose hosts hold the run (default: cluster.yml)",
        "run-id": "the run to look at (default: the newest live run of the cluster file)",
    },
)
def stacks(c: Context, cluster: Optional[str] = None, run_id: Optional[str] = None) -> None:
    """Show where every rank of a live run is: its Python stack, grouped by place.

    Reaches the hosts itself, like cleanup (nothing is asked of the launcher, and the
    run goes on). With py-spy on a host (`pip install fdl-fabric[stacks]`), every
    thread's Python stack; without it, what /proc says.
    """
    code = run_stacks(_cluster_file(c, cluster), run_id=run_id)
    if code:
        raise Exit(code=code)


@task(
    help={
        "cluster": "cluster file (default: cluster.yml)",
        "json": "print the report as JSON: {\"checks\": [...], \"ok\": bool}",
        "cmd": "command whose program is checked on every host (default: `command:` of the "
        "cluster file); or give the words after `--`",
        "fast": "only what `inv launch` checks before spawning: ssh, paths, program, port",
    },
    name="prebuild-check",
)
def prebuild_check(
    c: Context,
    cluster: Optional[str] = None,
    json: bool = False,
    cmd: Optional[str] = None,
    fast: bool = False,
) -> None:
    """Check every host of the cluster before launching: one row per host and check.

    SSH and host keys, shell tools, paths and disk, the program, platform, GPUs,
    data_path, clock skew and the controller port, all hosts in parallel.
    Exit 0 when nothing FAILs, 1 otherwise, 2 on a config error.
    """
    code = check_cluster(_cluster_file(c, cluster), cmd=cmd, words=_remainder(),
                         as_json=json, fast=fast)
    if code:
        raise Exit(code=code)


PLOT_USAGE = """Usage: plot-run RUN_DIR [--output FILE.svg|FILE.png]

Draw a run's timeline: each rank's attempts against time, coloured by how they ended.

  RUN_DIR              <log-dir>/<run_id> of a run launched with --log-dir
  -o, --output FILE    picture to write, .svg or .png
                       (default: RUN_DIR/timeline.svg and RUN_DIR/timeline.png)"""


@task(help={"run-dir": "<log-dir>/<run_id> of a run launched with --log-dir",
            "output": "picture to write, .svg or .png "
                      "(default: <run-dir>/timeline.svg and timeline.png)"})
def plot_run(c: Context, run_dir: str, output: str = "") -> None:
    """Draw a run's timeline: each rank's attempts against time, coloured by how they ended."""
    if run_dir in ("-h", "--help"):  # invoke hands a positional the next word, --help too
        print(PLOT_USAGE)
        return
    events = EventBus(Console())
    try:
        drawn = draw(run_dir, output)
    except ImportError as exc:  # matplotlib: the `plot` extra
        events(Name.PLOT_FAILED, run_dir=run_dir,
               error=f"{exc.name or exc} is not installed (pip install 'fdl-fabric[plot]')")
        raise Exit(code=2) from None
    except (OSError, ValueError) as exc:  # no such run folder, no events in it, a bad name
        events(Name.PLOT_FAILED, run_dir=run_dir, error=str(exc))
        raise Exit(code=2) from None
    for path in drawn:
        events(Name.PLOT_DRAWN, path=str(path))


def _usage_errors_exit_2() -> None:
    """invoke exits 1 when it cannot parse a task's flags; our tasks promise 2 for every
    usage error (docs/cli.md), under ``inv`` as under ``fdl-fabric``. Only parse errors of
    this collection's tasks change; invoke prints the message either way."""
    from invoke.exceptions import ParseError
    from invoke.program import Program

    original = Program.parse_tasks
    if getattr(original, "_fdl_usage_exit", False):
        return

    def parse_tasks(self: Program) -> None:
        try:
            original(self)
        except ParseError as exc:
            name = str(getattr(exc.context, "name", "") or "")
            if name.rpartition(".")[2] in TASK_NAMES:
                from .commands.cli import usage_line

                raise Exit(usage_line(exc, sys.argv, binary="inv"), code=2) from None
            raise

    parse_tasks._fdl_usage_exit = True  # type: ignore[attr-defined]
    Program.parse_tasks = parse_tasks  # type: ignore[method-assign]


#: This collection's tasks, by their command-line names.
TASK_NAMES = frozenset({"launch", "cleanup", "prebuild-check", "plot-run", "stacks",
                        "status"})
_usage_errors_exit_2()

@task(
    help={
        "cluster": "cluster file whose hosts are asked (default: cluster.yml)",
        "hosts": "ask these hosts instead: node[1-4],gpu[01-02]",
        "hostfile": "ask the hosts of a DeepSpeed/MPI hostfile instead",
        "ssh-config": "with --hosts/--hostfile: an ssh_config file (like ssh -F)",
        "all": "every live run on those hosts, not only this cluster's",
        "json": "print the runs as JSON",
    },
)
def status(c: Context, cluster: Optional[str] = None, hosts: Optional[str] = None,
           hostfile: Optional[str] = None, ssh_config: Optional[str] = None,
           all: bool = False, json: bool = False) -> None:
    """List the live runs on the cluster's hosts: run id, launcher, uptime, ranks.

    Read from the records each host keeps; the runs are never touched. Exit 0, or 1 when
    a host could not be asked, 2 on bad input.
    """
    try:
        from_hosts = flags.hosts_cluster(hosts, hostfile, ssh_config, None,
                                         cluster_given=cluster is not None)
    except FdlError as exc:
        raise Exit(str(exc), code=exc.exit_code) from None
    code = run_status(None if from_hosts else _cluster_file(c, cluster),
                      cluster=from_hosts, every_run=all or from_hosts is not None,
                      as_json=json)
    if code:
        raise Exit(code=code)


ns = Collection("fdl")
ns.add_task(launch)
ns.add_task(cleanup)
ns.add_task(prebuild_check)
ns.add_task(plot_run, name="plot-run")
ns.add_task(stacks)
ns.add_task(status)
ns.configure({"fdl": dict(CONFIG_DEFAULTS)})
