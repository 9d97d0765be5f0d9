"""``fdl-fabric run``: a single-host drop-in for ``torchrun``.

Replace ``torchrun`` with ``fdl-fabric run`` in a command line and it works the same:
the same common flags, the same worker environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT, TORCHELASTIC_*...), ``--max-restarts`` with ``attempt_N`` log
folders, error files with a root-cause summary. What it adds is fdl-fabric's
supervision on this machine: one agent that leashes every worker (nothing outlives the
launcher, not even a daemon), kill-all with a clear verdict, the live table, and
``--log-dir`` kept byte for byte. No cluster.yml is needed; for several hosts, write
one and use ``fdl-fabric launch``.

torchrun's flags that have no meaning here are refused with what to use instead, never
silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import secrets
import socket
import sys
from typing import NoReturn, Optional

from ..agent.checks import gpu_indices
from ..clusterfile import ClusterSpec, ControllerSpec, ElasticSpec, SshSpec, WorkerSpec
from ..errors import EXIT_USAGE, FdlError, usage
from ..events import EventBus, Name
from ..presentation.output import Console
from . import flags
from .launch import LaunchOptions, launch

#: torchrun flags that do not apply to one host, and what to use instead.
REFUSED = {
    "rdzv-backend": "rendezvous is fdl-fabric's own: for several hosts write a cluster.yml "
                    "and use `fdl-fabric launch`",
    "rdzv-endpoint": "for several hosts write a cluster.yml and use `fdl-fabric launch`",
    "rdzv-id": "the run id is generated (TORCHELASTIC_RUN_ID); for several hosts use "
               "`fdl-fabric launch`",
    "rdzv-conf": "for several hosts write a cluster.yml and use `fdl-fabric launch`",
    "node-rank": "`fdl-fabric run` is one host; for several use `fdl-fabric launch`",
    "redirects": "every rank's output is forwarded with a [host:device:rN] prefix; "
                 "--log-dir keeps each rank's stdout and stderr",
    "tee": "every rank's output is forwarded with a [host:device:rN] prefix; --log-dir "
           "keeps each rank's stdout and stderr",
    "local-ranks-filter": "every rank's output is shown (use --quiet for none; --log-dir "
                          "keeps each rank's output apart)",
    "role": "fdl-fabric has one role, `default` (ROLE_NAME)",
    "monitor-interval": "exits are reported the moment they happen; there is no interval",
    "start-method": "workers are always separate processes (fork and exec)",
    "run-path": "run the script as a process (drop --run-path)",
    "signals-to-handle": "SIGINT and SIGTERM stop every rank, SIGUSR1/2 are forwarded",
    "shutdown-timeout": "use --kill-grace (seconds between TERM and KILL)",
    "local-addr": "the coordinator listens on loopback for one host",
    "event-log-handler": "use --log-dir: it keeps events.jsonl",
    "logs-specs": "use --log-dir",
    "numa-binding": "not supported; bind inside your program",
    "virtual-local-rank": "not supported: LOCAL_RANK is the rank's index on the host",
    "duplicate-stdout-filters": "use --log-dir and grep its files",
    "duplicate-stderr-filters": "use --log-dir and grep its files",
}


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line naming the flag, exit 2 (`main` says it as
    it says every other bad value), not its usage block."""

    def error(self, message: str) -> NoReturn:
        raise FdlError(_one_line(message), EXIT_USAGE)


def _one_line(message: str) -> str:
    """argparse's ``argument --a/--a_b: ...`` as ``--a: ...``, as every other flag is named."""
    named = re.fullmatch(r"argument ([^/:\s]+)(?:/\S+)?: (.*)", message, re.DOTALL)
    if named is not None:
        flag, what = named.groups()
        what = {"expected one argument": "expected a value"}.get(what, what)
        what = re.sub(r"^ignored explicit argument (.*)", r"takes no value, got \1", what)
        message = f"{flag}: {what}"
    unknown = re.fullmatch(r"unrecognized arguments: (.+)", message)
    if unknown is not None:
        given = [word.split("=", 1)[0] for word in unknown.group(1).split()]
        message = f"{', '.join(given)}: no such flag{'s' if len(given) > 1 else ''}"
    return f"{' '.join(message.split())} (fdl-fabric run --help lists the flags)"


def _both(name: str) -> list[str]:
    """torchrun accepts `--nproc-per-node` and `--nproc_per_node` alike."""
    return [f"--{name}", f"--{name.replace('-', '_')}"]


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fdl-fabric run", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                epilog="Other torchrun flags are refused with what to use instead. "
                "Exit codes: 0 ok, 1 failure, 2 usage error, 130/143 interrupted.")
    p.add_argument(*_both("nproc-per-node"), default="1", metavar="N",
                   help="ranks on this host: a number, or gpu, cpu, auto (as torchrun)")
    p.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="with --hosts: the fewest hosts an attempt may run on, and how "
                   "many start (the rest are spares); without, 1")
    p.add_argument("--hosts", default=None, metavar="LIST",
                   help="run on these hosts over SSH: node[1-4],gpu[01-02]")
    p.add_argument("--hostfile", default=None, metavar="FILE",
                   help="the hosts from a DeepSpeed/MPI hostfile (`host slots=N`)")
    p.add_argument("-F", "--ssh-config", default=None, metavar="FILE",
                   help="an ssh_config file instead of ~/.ssh/config (like ssh -F)")
    p.add_argument("--standalone", action="store_true", help="accepted, nothing to do")
    p.add_argument(*_both("master-port"), type=int, default=None, metavar="PORT",
                   help="MASTER_PORT for torch.distributed (default: a free port)")
    p.add_argument(*_both("master-addr"), default="127.0.0.1", metavar="ADDR",
                   help="MASTER_ADDR (default 127.0.0.1)")
    p.add_argument(*_both("max-restarts"), default=None, metavar="N",
                   help="start every rank again up to N times after a failure")
    p.add_argument(*_both("log-dir"), default=None, metavar="DIR",
                   help="keep DIR/<run_id>/attempt_<k>/r<rank>/{stdout,stderr}.log, "
                   "error.json, events.jsonl")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the script as a module, like python -m")
    p.add_argument(*_both("no-python"), action="store_true",
                   help="run the script directly, not with python")
    p.add_argument(*_both("kill-grace"), default="30", metavar="S",
                   help="seconds between TERM and KILL when stopping ranks (default 30, "
                   "as torchrun's shutdown timeout)")
    p.add_argument(*_both("hang-timeout"), default=None, metavar="S",
                   help="seconds without output or progress from any rank after which the "
                   "run is hung: every rank's stack is shown, exit 1 (default: off)")
    p.add_argument("--json", action="store_true",
                   help="every event as one JSON line on stdout, the verdict last")
    p.add_argument("--quiet", action="store_true", help="no rank output")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more detail (-v, -vv)")
    p.add_argument("training_script", help="the script (or module, with -m) every rank runs")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _refuse_torchrun_only_flags(argv: list[str]) -> None:
    """Before argparse: a torchrun flag we do not take gets its own explanation, wherever
    it stands among our own flags (their values are skipped, not taken for the script)."""
    valued = {option for action in parser()._actions if action.nargs != 0
              for option in action.option_strings}
    words = iter(argv)
    for word in words:
        if not word.startswith("--"):
            if not word.startswith("-"):
                return  # the script: everything after it is the script's own
            if word in valued:
                next(words, None)
            continue
        if word in valued:  # `--flag value`: the value is not the script
            next(words, None)
            continue
        name = word[2:].split("=", 1)[0].replace("_", "-")
        if name in REFUSED:
            raise usage(f"--{name}", f"not supported by `fdl-fabric run`: "
                              f"{REFUSED[name]}")


def nproc(value: str) -> int:
    """torchrun's --nproc-per-node: a number, or gpu / cpu / auto."""
    text = value.strip().lower()
    count: Optional[int] = None
    if text.isascii() and text.isdigit():
        count = int(text)
    elif text in ("gpu", "auto"):
        count = _gpu_count() or None
        if count is None and text == "gpu":
            raise usage("--nproc-per-node", "gpu: no GPU found (nvidia-smi)")
    if count is None and text in ("cpu", "auto"):
        count = os.cpu_count() or 1
    if count is None:
        raise usage("--nproc-per-node", f"expected a number, gpu, cpu or auto, got {value!r}")
    # The bound of a worker's nproc in a cluster file, checked by the same function.
    return flags.nproc_per_node("--nproc-per-node", str(count)) or count


def _gpu_count() -> int:
    return len(gpu_indices().get("gpus") or [])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_argv(args: argparse.Namespace) -> list[str]:
    """What every rank runs, as torchrun builds it."""
    script_args = list(args.training_script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    if args.no_python:
        if args.module:
            raise usage("--no-python", "cannot be combined with -m")
        return [args.training_script, *script_args]
    if args.module:
        return [sys.executable, "-u", "-m", args.training_script, *script_args]
    return [sys.executable, "-u", args.training_script, *script_args]


def nnodes(text: str) -> tuple[int, int]:
    """torchrun's ``--nnodes N`` or ``MIN:MAX``."""
    low, _, high = text.strip().partition(":")
    high = high or low
    if not (low.isascii() and low.isdigit() and high.isascii() and high.isdigit()) \
            or not 1 <= int(low) <= int(high):
        raise usage("--nnodes", f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return int(low), int(high)


def hosts_cluster_for(args: argparse.Namespace) -> Optional[ClusterSpec]:
    """``--hosts`` / ``--hostfile``: a multi-host run, torchrun's command line on the
    hosts given; ``--nnodes MIN:MAX`` maps onto ``elastic.min_hosts`` and spares."""
    if args.hosts is None and args.hostfile is None:
        return None
    low, high = nnodes(args.nnodes) if args.nnodes.strip() not in ("1", "1:1") else (0, 0)
    per_node = None if args.nproc_per_node.strip() == "1" else nproc(args.nproc_per_node)
    grace = flags.seconds("--kill-grace", args.kill_grace)
    top: dict[str, object] = {
        "kill_grace": 30.0 if grace is None else grace,
        "elastic": {"max_restarts": flags.restarts("--max-restarts", args.max_restarts) or 0}}
    if args.master_port is not None:
        top["master_port"] = args.master_port
    cluster = flags.hosts_cluster(args.hosts, args.hostfile, args.ssh_config, per_node,
                                  cluster_given=False, max_hosts=high or None, **top)
    assert cluster is not None
    roster = sum(1 for w in cluster.workers if not w.spare)
    if low and low > roster:
        raise usage("--nnodes", f"MIN is {low}, but only {roster} host(s) were given")
    if not low:
        return cluster
    # `elastic.min_hosts` of the file, once the hosts it needs are known to be there (the
    # schema would say the same of `--hosts`, without naming --nnodes).
    return dataclasses.replace(cluster, elastic=dataclasses.replace(cluster.elastic,
                                                                    min_hosts=low))


def cluster_for(args: argparse.Namespace) -> ClusterSpec:
    """The cluster a ``run`` means (what a cluster.yml would say): the hosts of
    ``--hosts``/``--hostfile``, else this one host."""
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise usage("--master-port", f"expected 1-65535, got {args.master_port}")
    from_hosts = hosts_cluster_for(args)
    if from_hosts is not None:
        return from_hosts
    if args.ssh_config is not None:
        raise usage("--ssh-config", "only with --hosts or --hostfile")
    if args.nnodes.strip() not in ("1", "1:1"):
        raise usage("--nnodes", f"`fdl-fabric run` without --hosts is one host, got "
                    f"{args.nnodes!r}: give the hosts with --hosts or --hostfile, or write "
                    "a cluster.yml for `fdl-fabric launch`")
    grace = flags.seconds("--kill-grace", args.kill_grace)
    cwd = os.getcwd()
    worker = WorkerSpec(index=0, host="localhost", nproc=nproc(args.nproc_per_node),
                        local_devices=None, path=cwd, addr=args.master_addr,
                        nccl_socket_ifname=None, ssh=SshSpec(), tunnel=False, env={},
                        data_path=None, is_local=True, line=0, transport="local")
    return ClusterSpec(
        file="fdl-fabric run", folder=cwd,
        controller=ControllerSpec(host="127.0.0.1", port=free_port()),
        command=None, env={}, kill_grace=30.0 if grace is None else grace,
        master_port=args.master_port or free_port(),
        elastic=ElasticSpec(max_restarts=flags.restarts("--max-restarts", args.max_restarts)
                            or 0),
        workers=(worker,),
        # Each run is a cluster of its own: two jobs started from one folder never see
        # each other as leftovers.
        key=f"run-{secrets.token_hex(8)}")


def main(argv: Optional[list[str]] = None) -> int:
    """``fdl-fabric run [torchrun flags] script.py args...``: returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        _refuse_torchrun_only_flags(args_list)
        args = parser().parse_args(args_list)
        # Every flag first; the cluster last, as it looks the first host up.
        words = worker_argv(args)
        hang_timeout = flags.seconds("--hang-timeout", args.hang_timeout)
        log_dir = flags.log_dir(args.log_dir)
        opts = LaunchOptions(
            cluster=cluster_for(args), argv=words,
            verbosity=1 + min(args.verbose, 2), quiet=args.quiet,
            log_dir=log_dir, hang_timeout=hang_timeout, json=args.json,
            # The pre-flight refuses a missing script or module (or a folder) before any
            # rank starts, instead of starting every rank (and every restart) to fail.
            preflight=True)
    except FdlError as exc:
        EventBus(Console())(Name.REFUSED, command="fdl-fabric run", error=str(exc))
        return exc.exit_code
    return launch(opts)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
