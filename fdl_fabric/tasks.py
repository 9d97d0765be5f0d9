"""The Invoke task collection: ``inv launch`` and friends.

Each task imports what it runs when it runs: the collection itself stays light, so a
``--detach`` front or ``--help`` never pays for the launcher's imports.

Import it into another repo's tasks.py with
``ns.add_collection(fdl_fabric.tasks.ns, "fdl")``; the root ``tasks.py`` of
this repo and the ``fdl-fabric`` console script use the same collection.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any, Callable, Optional

from invoke.collection import Collection
from invoke.context import Context
from invoke.exceptions import Exit
from invoke.tasks import Task, task

from .clusterfile import ClusterSpec
from .commands import flags, vocabulary
from .commands.heap import left_to_the_os
from .commands.options import hosts_cluster, launch_options, refuse
from .errors import FdlError
from .events import EventBus, Name
from .limits import RANKS_MAX


class _ChosenShortFlags(Task[Any]):
    """A task whose short flags are chosen (`commands.vocabulary`), not derived from
    letters: invoke's automatic ones gave ``-m`` for ``--cmd`` (torchrun's ``-m`` is a
    module), ``-n`` for ranks per host (srun's ``-n`` is total tasks) and ``-h`` for
    ``--hang-timeout`` or ``--hosts`` (``-h`` is help everywhere)."""

    def arg_opts(self, name: str, default: str, taken_names: set[str]) -> dict[str, Any]:
        opts: dict[str, Any] = super().arg_opts(name, default, taken_names)
        short = vocabulary.short_flags(self.name.replace("_", "-")).get(name)
        opts["names"] = opts["names"][:1] + ([short] if short else [])
        return opts


def _task(command: str, **kw: Any) -> Callable[[Callable[..., Any]], Task[Any]]:
    """An inv task of ``command`` whose flags are the vocabulary's: its body takes
    ``(c, **given)``, and the signature invoke parses is written from the table (a switch
    defaults to False, or True for ``--no-…``; a value to None, meaning not given).
    A task's run leaves the heap to the OS at the program's exit (`left_to_the_os`)."""
    kw.setdefault("help", vocabulary.task_help(command))

    def make(body: Callable[..., Any]) -> Task[Any]:
        if "given" in inspect.signature(body).parameters:
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            body.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
                [inspect.Parameter("c", kind)] + [
                    inspect.Parameter(f.name, kind, default=f.on_by_default
                                      if f.metavar is None and not f.counted else None)
                    for f in vocabulary.flags_of(command)])

        @functools.wraps(body)
        def run(*args: Any, **given: Any) -> Any:
            left_to_the_os()
            return body(*args, **given)

        made: Task[Any] = task(klass=_ChosenShortFlags, name=command, **kw)(run)
        return made

    return make


#: Defaults for the ``fdl`` config section: set them in invoke.yaml / fabric.yaml
#: (``fdl: {cluster: lab.yml, log_dir: runs/logs}``) or the environment
#: (``INVOKE_FDL_CLUSTER=lab.yml``); command-line flags win.
CONFIG_DEFAULTS = {"cluster": "cluster.yml", "log_dir": ""}


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


def _refused(exc: FdlError, command: str, as_json: bool = False) -> Exit:
    """A refusal of ``command``: one line that starts with the flag (and a JSON record
    under ``--json``), exit 2."""
    refuse(exc, None, as_json=as_json)
    return Exit(code=exc.exit_code)


def _binary() -> str:
    """``inv`` when invoke's own program runs (``inv``, ``invoke``, ``python -m invoke``),
    else ``fdl-fabric``."""
    path = sys.argv[0] if sys.argv else ""
    name, folder = os.path.basename(path), os.path.basename(os.path.dirname(path))
    return "inv" if name in ("inv", "invoke") or folder == "invoke" else "fdl-fabric"


@_task("launch", optional=["verbose"])
def launch(c: Context, **given: Any) -> None:
    """Launch the job of the cluster file (or --hosts), supervised to a verdict.

    Exit codes: 0 ok (or degraded), 1 run failure, 2 config or usage error,
    130/143 interrupted by SIGINT/SIGTERM.
    """
    try:
        opts = launch_options(given, command="launch", argv=_remainder(),
                              settings=_settings(c))
    except FdlError as exc:
        raise _refused(exc, "launch", bool(given.get("json"))) from None
    if given.get("on"):
        code = _launch_on(c, given, opts.cluster_file)
    else:
        from .commands.launch import launch as run_launch

        code = run_launch(opts, binary=_binary())
    if code:
        raise Exit(code=code)


def _launch_on(c: Context, given: dict[str, Any], cluster_file: Optional[str]) -> int:
    """``launch --detach --on HOST``: checked here first (exit 2), started there."""
    from .commands.onhost import launch_there

    if not given.get("detach"):
        raise _refused(FdlError("--on: only with --detach: a foreground launch belongs to "
                                "this terminal (add --detach)", 2), "launch")
    if cluster_file is not None and not os.path.isfile(cluster_file):
        raise _refused(FdlError(f"{cluster_file}: no such cluster file", 2), "launch")
    try:
        return launch_there(given["on"], given, _remainder(), cluster_file)[0]
    except FdlError as exc:
        from .presentation.output import Console

        Console().message(str(exc))
        return exc.exit_code


def _there(command: str, given: dict[str, Any]) -> None:
    """``--on HOST`` for a command on a run: the same command there."""
    from .commands.onhost import run_there

    try:
        code = run_there(given["on"], command, given, pty=command == "attach")
    except FdlError as exc:
        from .presentation.output import Console

        Console().message(str(exc))
        raise Exit(code=exc.exit_code) from None
    if code:
        raise Exit(code=code)


def _hosts(c: Context, command: str, values: dict[str, Any]) -> tuple[Optional[str],
                                                                     Optional[ClusterSpec]]:
    """A command's hosts: the cluster file, or the hosts of ``--hosts``/``--hostfile``
    (checked; a bad one is exit 2 naming the flag)."""
    try:
        from_hosts = hosts_cluster(values, command=command)
        if from_hosts is not None:
            return None, from_hosts
        if values.get("slurm"):
            return values.get("cluster"), None
        return flags.cluster_file(values.get("cluster"), _settings(c)["cluster"]), None
    except FdlError as exc:
        raise _refused(exc, command, bool(values.get("json"))) from None


@_task("cleanup")
def cleanup(c: Context, **given: Any) -> None:
    """Stop leftover ranks on every host of the cluster, then verify none remains.

    Only processes of runs recorded by fdl-fabric's agents are stopped: a rank's
    process group while its leader is the one the agent started, and processes that
    carry the run's id. A run whose launcher is alive is left alone unless named with
    --run-id or --force is given. Exit 1 if anything survives.
    """
    file, from_hosts = _hosts(c, "cleanup", given)
    try:
        pattern = flags.pattern(given.get("pattern"))
    except FdlError as exc:
        raise _refused(exc, "cleanup") from None
    from .commands.cleanup import run_cleanup

    code = run_cleanup(file, cluster=from_hosts, run_id=given.get("run_id"),
                       all_runs=bool(given.get("all")) or from_hosts is not None,
                       pattern=pattern, slurm=bool(given.get("slurm")),
                       force=bool(given.get("force")))
    if code:
        raise Exit(code=code)


@_task("stacks")
def stacks(c: Context, **given: Any) -> None:
    """Show where every rank of a live run is: its Python stack, grouped by place.

    Reaches the hosts itself, like cleanup (nothing is asked of the launcher, and the
    run goes on). With py-spy on a host (`pip install fdl-fabric[stacks]`), every
    thread's Python stack; without it, what /proc says.
    """
    file, from_hosts = _hosts(c, "stacks", given)
    from .commands.stacks import run_stacks

    code = run_stacks(file, cluster=from_hosts, run_id=given.get("run_id"),
                      every_run=from_hosts is not None)
    if code:
        raise Exit(code=code)


@_task("prebuild-check")
def prebuild_check(c: Context, **given: Any) -> None:
    """Check every host of the cluster before launching: one row per host and check.

    SSH and host keys, shell tools, paths and disk, the program, platform, GPUs,
    data_path, clock skew and the controller port, all hosts in parallel.
    Exit 0 when nothing FAILs, 1 otherwise, 2 on a config error.
    """
    file, from_hosts = _hosts(c, "prebuild-check", given)
    from .commands.trusted import untrusted
    from .preflight import check_cluster

    code = check_cluster(file, cluster=from_hosts, cmd=given.get("cmd"), words=_remainder(),
                         as_json=bool(given.get("json")), fast=bool(given.get("fast")),
                         smoke=bool(given.get("smoke")),
                         trust_ssh_config=bool(given.get("trust_ssh_config")),
                         file_untrusted=untrusted(file) if file and os.path.isfile(file)
                         else f"{file} is not a file of yours")
    if code:
        raise Exit(code=code)


@_task("plot-run", help={**vocabulary.task_help("plot-run"),
                         "run-dir": "<log-dir>/<run_id> of a run launched with --log-dir"})
def plot_run(c: Context, run_dir: str, output: str = "") -> None:
    """Draw a run's timeline: each rank's attempts against time, coloured by how they ended."""
    if run_dir in ("-h", "--help"):  # invoke hands a positional the next word, --help too
        vocabulary.write_page(vocabulary.help_page("plot-run", binary=_binary()))
        return
    from .presentation.output import Console
    from .presentation.plot import plot_run as draw

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
        self.core.unparsed[:] = vocabulary.named_run(list(self.core.unparsed))
        try:
            original(self)
        except ParseError as exc:
            name = str(getattr(exc.context, "name", "") or "")
            if name.rpartition(".")[2] in TASK_NAMES:
                from .commands.usage import usage_line

                raise Exit(usage_line(exc, sys.argv, binary="inv"), code=2) from None
            raise

    def print_task_help(self: Program, name: str) -> None:
        """One help format: this collection's tasks print `vocabulary.help_page`."""
        command = name.rpartition(".")[2]
        if command not in TASK_NAMES or command == "run":
            original_help(self, name)
            return
        binary = "fdl-fabric" if self.binary == "fdl-fabric" else f"inv {name}"
        page = vocabulary.help_page(command, binary=binary)
        if binary != "fdl-fabric":
            page = page.replace(f"inv {name} {command}", f"inv {name}", 1)
        vocabulary.write_page(page)

    original_help = Program.print_task_help
    parse_tasks._fdl_usage_exit = True  # type: ignore[attr-defined]
    Program.parse_tasks = parse_tasks  # type: ignore[method-assign]
    Program.print_task_help = print_task_help  # type: ignore[method-assign]


#: This collection's tasks, by their command-line names.
TASK_NAMES = frozenset({"run", "launch", "cleanup", "prebuild-check", "plot-run", "stacks",
                        "status", "attach", "logs", "stop", "wait", "join", "start"})
#: ``--tail``'s bound: more lines than any record holds.
TAIL_MAX = 10**9
_usage_errors_exit_2()

@_task("status")
def status(c: Context, **given: Any) -> None:
    """List this controller's runs, then the live runs on the cluster's hosts.

    Read from the records this machine and each host keep; the runs are never touched.
    Exit 0, or 1 when a host could not be asked, 2 on bad input.
    """
    if given.get("on"):
        _there("status", given)
        return
    if given.get("controller"):  # one join window, from anywhere, with its token
        from .commands.joincli import run_start

        code = run_start(given, what="status")
        if code:
            raise Exit(code=code)
        return
    file, from_hosts = _hosts(c, "status", given)
    # The hosts' view when hosts are named, or the default cluster file is there: this
    # controller's runs need neither.
    named = from_hosts is not None or given.get("cluster") is not None
    from .commands.status import run_status

    code = run_status(file, cluster=from_hosts,
                      every_run=bool(given.get("all")) or from_hosts is not None,
                      as_json=bool(given.get("json")), ended_too=bool(given.get("all")),
                      hosts=named or (file is not None and os.path.exists(file)))
    if code:
        raise Exit(code=code)


def _of_a_run(command: str, given: dict[str, Any], call: Callable[[], int]) -> None:
    """A command on one run of this controller: its flags were checked by ``call``'s
    arguments; a bad one is exit 2 naming it. With ``--on HOST``, the same there."""
    if given.get("on"):
        _there(command, given)
        return
    try:
        code = call()
    except FdlError as exc:
        raise _refused(exc, command) from None
    if code:
        raise Exit(code=code)


@_task("attach")
def attach(c: Context, **given: Any) -> None:
    """Show a run's output so far, then follow it live; Ctrl-C leaves it running."""
    from .commands.attach import run_attach

    _of_a_run("attach", given, lambda: run_attach(
        given.get("run_id"), tail=flags.whole("--tail", given.get("tail"), TAIL_MAX),
        stop=bool(given.get("stop"))))


@_task("logs")
def logs(c: Context, **given: Any) -> None:
    """Print a run's output; -f follows it to its verdict."""
    from .commands.follow import run_logs

    _of_a_run("logs", given, lambda: run_logs(
        given.get("run_id"), follow_on=bool(given.get("follow")),
        rank=flags.whole("--rank", given.get("rank"), RANKS_MAX - 1),
        host=given.get("host"), tail=flags.whole("--tail", given.get("tail"), TAIL_MAX)))


@_task("stop")
def stop(c: Context, **given: Any) -> None:
    """Stop a run: TERM to every rank, KILL after the kill grace (--kill: at once)."""
    from .commands.stopping import run_stop

    _of_a_run("stop", given, lambda: run_stop(given.get("run_id"),
                                              kill=bool(given.get("kill"))))


@_task("wait")
def wait(c: Context, **given: Any) -> None:
    """Wait for a run's end and exit with its exit code (124 after --timeout)."""
    from .commands.stopping import run_wait

    _of_a_run("wait", given, lambda: run_wait(
        given.get("run_id"), timeout=flags.seconds("--timeout", given.get("timeout"))))


@_task("join")
def join(c: Context, **given: Any) -> None:
    """Join a launch's join window from this worker: fdl-fabric join HOST:PORT."""
    from .commands.joincli import run_join

    code = run_join(given)
    if code:
        raise Exit(code=code)


@_task("start")
def start(c: Context, **given: Any) -> None:
    """Start a join window that waits for the operator (start: manual or hybrid)."""
    from .commands.joincli import run_start

    code = run_start(given)
    if code:
        raise Exit(code=code)


@task(name="run")
def run_task(c: Context) -> None:
    """torchrun's command line: inv run -- [flags] SCRIPT [ARGS...] (fdl-fabric run).

    The words after `--` are fdl-fabric run's: `inv run -- --help` lists its flags."""
    from .commands.run import main as run_main

    code = run_main(_remainder())
    if code:
        raise Exit(code=code)


ns = Collection("fdl")
ns.add_task(run_task, name="run")
ns.add_task(launch)
ns.add_task(cleanup)
ns.add_task(prebuild_check)
ns.add_task(plot_run, name="plot-run")
ns.add_task(stacks)
ns.add_task(status)
ns.add_task(attach)
ns.add_task(logs)
ns.add_task(stop)
ns.add_task(wait)
ns.add_task(join)
ns.add_task(start)
ns.configure({"fdl": dict(CONFIG_DEFAULTS)})
